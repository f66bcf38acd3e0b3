"""Fused attention: which spelled-out attention chains the Relax pass replaces (and which it must
leave), the CUDA the kernel is, and (GPU) its numbers alone and inside whole fp16 models."""

import math

import numpy as np
import pytest
import torch
import tvm
from torch import nn

import tvm_ext
from examples.torch_models import BertLayer, LlamaLayer, attention as spelled_attention
from schedules import attention
from tvm_ext.attention import fuse_attention

SM_90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def bert(seq=64, hidden=128, heads=2):  # head dim 64
    return BertLayer(hidden, heads, 2 * hidden).eval().half(), torch.randn(2, seq, hidden).half()


def llama(seq=64, hidden=256, heads=2):  # head dim 128, causal
    return LlamaLayer(hidden, heads, 2 * hidden).eval().half(), torch.randn(1, seq, hidden).half()


class Masked(nn.Module):
    """Attention with a constant additive mask that is not causal (the diagonal masked)."""

    def forward(self, q, k, v):
        n = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores + torch.diag(torch.full((n,), float("-inf"))).nan_to_num(0, float("-inf")).to(scores.dtype)
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


class ReturnsProbabilities(nn.Module):
    """Attention whose probabilities are also an output: the chain has another use."""

    def forward(self, q, k, v):
        probs = torch.softmax((torch.matmul(q, k.transpose(-1, -2)) / 8).float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, v), probs


def fused(mod, target=SM_90A) -> tvm.IRModule:
    with target:
        return fuse_attention(mod)


def calls_of(mod) -> list[str]:
    return [gv.name_hint for gv in mod.get_global_vars() if gv.name_hint != "main"]


def ops_in(mod) -> str:
    return mod["main"].script()


def qkv(batch=2, heads=2, seq=64, dim=64):
    return [torch.randn(batch, heads, seq, dim).half() for _ in range(3)]


def test_bert_attention_becomes_one_call_without_softmax():
    mod = tvm_ext.from_torch(*bert())
    before, after = ops_in(mod), ops_in(fused(mod))
    assert before.count("R.matmul") == 6 and "R.nn.softmax" in before
    assert after.count("R.matmul") == 4 and "R.nn.softmax" not in after  # QK^T and PV are in the kernel
    assert after.count("R.call_tir(fused_attention") == 1 and calls_of(fused(mod)) == ["fused_attention"]
    # K is read as the model holds it, [batch * heads, seq, dim], not from a transposed copy
    assert after.count("R.permute_dims(") == before.count("R.permute_dims(") - 1


def test_llama_causal_mask_is_recognised_by_its_values():
    mod = tvm_ext.from_torch(*llama(seq=128))
    after = fused(mod)
    assert "R.nn.softmax" not in ops_in(after) and "R.where" not in ops_in(after)  # the mask is gone too
    kernel = after[next(gv for gv in after.get_global_vars() if gv.name_hint == "fused_attention")]
    text = kernel.script()
    assert "T.min(" in text and "T.if_then_else" in text  # key tiles stop at the diagonal; above it masked
    # the model divides by sqrt(128) as an fp16 constant, 11.3125; the kernel scales in log2 units
    assert f"{1 / 11.3125 * attention.LOG2E:.8f}" in text


@pytest.mark.parametrize("module", [Masked(), ReturnsProbabilities()], ids=["not-causal-mask", "probs-used"])
def test_chains_it_cannot_replace_are_left_alone(module):
    mod = tvm_ext.from_torch(module, *qkv())
    after = fused(mod)
    assert calls_of(after) == [] and "R.nn.softmax" in ops_in(after)


@pytest.mark.parametrize("target", [{"kind": "cuda", "arch": "sm_90"}, {"kind": "llvm"}])
def test_targets_without_wgmma_keep_the_spelled_out_chain(target):
    mod = tvm_ext.from_torch(*bert())
    assert calls_of(fused(mod, tvm.target.Target(target))) == []


def test_sizes_the_kernel_does_not_take_are_left_alone():
    mod = tvm_ext.from_torch(*bert(seq=48))  # 48 rows: not a whole warpgroup tile of queries
    assert calls_of(fused(mod)) == []
    with pytest.raises(ValueError, match="dim=96"):
        attention.kernel(4, 128, 128, 96, 0.1, False)


@pytest.mark.parametrize("dim, causal", [(64, False), (128, True)])
def test_the_cuda_is_two_warpgroup_mmas_around_an_online_softmax(dim, causal):
    func = attention.kernel(4, 128, 128, dim, 1 / math.sqrt(dim), causal).with_attr("global_symbol", "attention")
    lib = tvm.compile(tvm.IRModule({"attention": func}), target=SM_90A)
    src = (lib.mod if hasattr(lib, "mod") else lib).imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in src  # S: 64 keys per tile
    assert f"wgmma.mma_async.sync.aligned.m64n{dim}k16.f32.f16.f16" in src  # O += P V
    assert src.count("__shfl_xor_sync") == 8  # max and sum over the 4 lanes of a row, 2 rows per thread
    assert "exp2f" in src and "cp.async.cg.shared.global" in src
    assert ("for (int j = 0; j < 2;" in src) != causal  # causal: the key tiles a block walks depend on its rows


# ---- GPU ---------------------------------------------------------------------------------------


def reference(q, k, v, scale, causal):
    scores = (q.double() @ k.double().transpose(1, 2)) * scale
    if causal:
        scores += torch.triu(torch.full(scores.shape[-2:], float("-inf"), dtype=torch.float64, device=q.device), 1)
    return torch.softmax(scores, -1) @ v.double()


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_q, seq_kv, dim, causal", [
    (3, 128, 256, 64, False), (2, 192, 192, 128, True), (4, 64, 64, 64, True), (2, 256, 64, 128, False)])
def test_kernel_matches_float64_attention(batch, seq_q, seq_kv, dim, causal):
    scale = 1 / math.sqrt(dim)
    lib = tvm.compile(tvm.IRModule({"attention": attention.kernel(batch, seq_q, seq_kv, dim, scale, causal)
                                    .with_attr("global_symbol", "attention")}), target=tvm_ext.parse_target("cuda"))
    q, v = (torch.randn(batch, n, dim, device="cuda").half() for n in (seq_q, seq_kv))
    k = torch.randn(batch, seq_kv, dim, device="cuda").half() * 3  # scores spread over a wide range
    out = torch.full_like(q, float("nan"))
    lib["attention"](*[tvm.runtime.from_dlpack(x) for x in (q, k, v, out)])
    want = reference(q, k, v, scale, causal)
    assert float((out.double() - want).abs().max()) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("make", [bert, llama], ids=["bert", "llama"])
def test_fp16_models_with_fused_attention_match_pytorch(make):
    module, x = make(seq=128)
    executable = tvm_ext.build(tvm_ext.from_torch(module, x), "cuda")
    assert any("attention" in k for k in tvm_ext.cuda_kernels(executable))
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    got = VirtualMachine(executable, tvm.cuda(0))["main"](tvm.runtime.tensor(x.numpy(), tvm.cuda(0)))
    got = (got[0] if not hasattr(got, "numpy") else got).numpy().astype("float32")
    with torch.no_grad():
        want = module.float()(x.float()).numpy()
    np.testing.assert_allclose(got, want, atol=3e-2)
