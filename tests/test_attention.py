"""Fused attention: which spelled-out attention chains the Relax pass replaces (and which it must
leave), the CUDA the kernel is, and (GPU) its numbers alone and inside whole fp16 models. The chains
are built in Relax as `tvm_ext.from_torch` leaves them (CI has no PyTorch); the same checks on the
imported BERT and LLaMA layers run where PyTorch is installed."""

import math

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_ext
from bench.spelled import main_module
from schedules import attention
from schedules.strided_view import StridedView
from tvm_ext.attention import fuse_attention

SM_90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
CAUSAL = np.triu(np.full((64, 64), -np.inf, "float32"), 1)


def spelled(batch=2, heads=2, seq=64, dim=64, mask=None, probs_out=False, packed=False) -> tvm.IRModule:
    """softmax(q @ k^T / sqrt(dim) [+ mask]) @ v in fp16, one op per binding as the frontend writes it:
    the scores rounded to fp16, softmax in float32, k transposed then reshaped to [batch * heads].
    `packed`: BERT's layout, q, k and v sliced from one [batch, seq, 3 * heads * dim] projection and
    the heads merged back into [batch, seq, heads * dim] rows."""
    n = batch * heads
    q, k, v = (relax.Var(x, relax.TensorType([batch, heads, seq, dim], "float16")) for x in "qkv")
    qkv = relax.Var("qkv", relax.TensorType([batch, seq, 3 * heads * dim], "float16"))

    def unpacked(bb, qkv):
        heads_first = bb.emit(relax.op.permute_dims(
            bb.emit(relax.op.reshape(qkv, [batch, seq, 3, heads, dim])), [2, 0, 3, 1, 4]))
        q, k, v = (bb.emit(relax.op.squeeze(bb.emit(relax.op.strided_slice(heads_first, [0], [i], [i + 1])), [0]))
                   for i in range(3))
        out = body(bb, q, k, v)
        merged = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(out, [batch, heads, seq, dim])), [0, 2, 1, 3]))
        return bb.emit(relax.op.reshape(merged, [batch, seq, heads * dim]))

    def body(bb, q, k, v):
        q3 = bb.emit(relax.op.reshape(q, [n, seq, dim]))
        kt3 = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2])), [n, dim, seq]))
        s = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(q3, kt3, out_dtype="float32")), "float16"))
        s = bb.emit(relax.op.divide(bb.emit(relax.op.reshape(s, [batch, heads, seq, seq])),
                                    relax.const(math.sqrt(dim), "float16")))
        if mask is not None:
            s = bb.emit(relax.op.add(s, relax.const(mask.astype("float16"))))
        p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(bb.emit(relax.op.astype(s, "float32")))), "float16"))
        p3 = bb.emit(relax.op.reshape(p, [n, seq, seq]))
        o = bb.emit(relax.op.matmul(p3, bb.emit(relax.op.reshape(v, [n, seq, dim])), out_dtype="float32"))
        o = bb.emit(relax.op.astype(o, "float16"))
        return relax.Tuple([o, p]) if probs_out else o

    return main_module(unpacked, [qkv]) if packed else main_module(body, [q, k, v])


def fused(mod, target=SM_90A) -> tvm.IRModule:
    with target:
        return fuse_attention(mod)


def calls_of(mod) -> list[str]:
    return [gv.name_hint for gv in mod.get_global_vars() if gv.name_hint != "main"]


def ops_in(mod) -> str:
    return mod["main"].script()


def kernel_of(mod):
    return mod[next(gv for gv in mod.get_global_vars() if gv.name_hint == "fused_attention")].script()


def test_attention_becomes_one_call_that_reads_k_untransposed():
    mod = spelled()
    before, after = ops_in(mod), ops_in(fused(mod))
    assert before.count("R.matmul") == 2 and "R.nn.softmax" in before
    assert "R.matmul" not in after and "R.nn.softmax" not in after and calls_of(fused(mod)) == ["fused_attention"]
    assert "R.permute_dims" not in after  # K read as stored, [batch * heads, seq, dim]
    assert f"{0.125 * attention.LOG2E:.8f}" in kernel_of(fused(mod))  # 1 / sqrt(64), in log2 units


def test_packed_heads_are_read_and_written_in_place():
    """BERT's split of the packed projection and merge of the heads are views for the kernel: no
    copy is left, the kernel takes the packed tensor three times and returns the merged rows."""
    after = fused(spelled(packed=True))
    main = ops_in(after)
    for op in ("R.permute_dims", "R.strided_slice", "R.squeeze", "R.reshape"):
        assert op not in main
    assert "R.call_tir(fused_attention, (qkv, qkv, qkv), out_ty=R.Tensor((2, 64, 128)" in main
    kernel = kernel_of(after)
    for offset in ("128 + ", "256 + "):  # k and v start 2 heads x 64 and 4 x 64 into each packed row
        assert offset in kernel
    assert "bz // 2 * 24576" in kernel  # batch stride of the packed rows: 64 x 384


def test_a_causal_mask_is_recognised_by_its_values():
    text = kernel_of(fused(spelled(seq=64 * 2, mask=np.triu(np.full((128, 128), -np.inf, "float32"), 1))))
    assert "T.min(" in text and "T.if_then_else" in text  # key tiles stop at the diagonal; above it masked


def test_a_causal_mask_is_recognised_when_the_build_asks_for_cuda_graphs():
    """The mask is evaluated on the CPU in a clean PassContext: the caller's CUDA-graph option there
    asked for a CUDA runtime function, and the build failed."""
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        text = kernel_of(fused(spelled(seq=128, mask=np.triu(np.full((128, 128), -np.inf, "float32"), 1))))
    assert "T.if_then_else" in text


@pytest.mark.parametrize("module", [
    spelled(mask=np.where(np.eye(64), -np.inf, 0).astype("float32")),  # a constant mask, not causal
    spelled(mask=CAUSAL.T.copy()),  # the transposed causal mask
    spelled(probs_out=True),  # the probabilities are an output too
    spelled(seq=48),  # 48 queries: not a whole warpgroup tile
    spelled(dim=96),  # a head dim the kernel does not take
    spelled(dim=36),  # rows 72 bytes apart: not on 16-byte boundaries (the pass raised TypeError)
], ids=["diagonal-mask", "anti-causal-mask", "probs-used", "seq-48", "dim-96", "dim-36"])
def test_chains_it_cannot_replace_are_left_alone(module):
    after = fused(module)
    assert calls_of(after) == [] and "R.nn.softmax" in ops_in(after)


@pytest.mark.parametrize("target", [{"kind": "cuda", "arch": "sm_90"}, {"kind": "llvm"}])
def test_targets_without_wgmma_keep_the_spelled_out_chain(target):
    assert calls_of(fused(spelled(), tvm.target.Target(target))) == []


def test_sizes_the_kernel_does_not_take_are_a_clear_error():
    with pytest.raises(ValueError, match="dim=96"):
        attention.kernel(4, 128, 128, 96, 0.1, False)


def test_imported_bert_and_llama_layers_are_fused():
    torch = pytest.importorskip("torch")
    for make, causal in ((bert, False), (llama, True)):
        mod = tvm_ext.from_torch(*make(torch, seq=128))
        after = fused(mod)
        assert "R.nn.softmax" not in ops_in(after) and calls_of(after) == ["fused_attention"]
        assert ("T.if_then_else" in kernel_of(after)) == causal  # LLaMA's mask, built by ops, is causal


def bert(torch, seq=64, hidden=128, heads=2):  # head dim 64
    from examples.torch_models import BertLayer  # noqa: PLC0415 (PyTorch is optional)

    return BertLayer(hidden, heads, 2 * hidden).eval().half(), torch.randn(2, seq, hidden).half()


def llama(torch, seq=64, hidden=256, heads=2):  # head dim 128, causal
    from examples.torch_models import LlamaLayer  # noqa: PLC0415

    return LlamaLayer(hidden, heads, 2 * hidden).eval().half(), torch.randn(1, seq, hidden).half()


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


def reference(torch, q, k, v, scale, causal):
    scores = (q.double() @ k.double().transpose(1, 2)) * scale
    if causal:
        scores += torch.triu(torch.full(scores.shape[-2:], float("-inf"), dtype=torch.float64, device=q.device), 1)
    return torch.softmax(scores, -1) @ v.double()


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_q, seq_kv, dim, causal", [
    (3, 128, 256, 64, False), (2, 192, 192, 128, True), (4, 64, 64, 64, True), (2, 256, 64, 128, False)])
def test_kernel_matches_float64_attention(batch, seq_q, seq_kv, dim, causal):
    torch = pytest.importorskip("torch")
    scale = 1 / math.sqrt(dim)
    lib = tvm.compile(tvm.IRModule({"attention": attention.kernel(batch, seq_q, seq_kv, dim, scale, causal)
                                    .with_attr("global_symbol", "attention")}), target=tvm_ext.parse_target("cuda"))
    q, v = (torch.randn(batch, n, dim, device="cuda").half() for n in (seq_q, seq_kv))
    k = torch.randn(batch, seq_kv, dim, device="cuda").half() * 3  # scores spread over a wide range
    out = torch.full_like(q, float("nan"))
    lib["attention"](*[tvm.runtime.from_dlpack(x) for x in (q, k, v, out)])
    want = reference(torch, q, k, v, scale, causal)
    assert float((out.double() - want).abs().max()) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dim, causal", [(64, False), (128, True)])
def test_kernel_reads_packed_heads_and_writes_merged_rows(dim, causal):
    """Views in the kernel: q, k, v read from one [b, s, 3 * heads * dim] tensor, the output written
    as [b, s, heads * dim] rows, against float64 on the same data split and merged by PyTorch."""
    torch = pytest.importorskip("torch")
    b, s, h, scale = 2, 128, 3, 1 / math.sqrt(dim)
    heads_first = StridedView.contiguous([b, s, 3 * h * dim]).reshape([b, s, 3, h, dim]).permute([2, 0, 3, 1, 4])
    given = {name: ((b, s, 3 * h * dim), heads_first.slice(0, i, 1, 1).squeeze([0]).reshape([b * h, s, dim]))
             for i, name in enumerate("qkv")}
    given["out"] = ((b, s, h * dim), StridedView.contiguous([b, s, h * dim]).reshape([b, s, h, dim])
                    .permute([0, 2, 1, 3]).reshape([b * h, s, dim]))
    func = attention.kernel(b * h, s, s, dim, scale, causal, given=given).with_attr("global_symbol", "attention")
    lib = tvm.compile(tvm.IRModule({"attention": func}), target=tvm_ext.parse_target("cuda"))
    qkv = torch.randn(b, s, 3 * h * dim, device="cuda").half()
    out = torch.full((b, s, h * dim), float("nan"), device="cuda").half()
    lib["attention"](*[tvm.runtime.from_dlpack(x) for x in (qkv, qkv, qkv, out)])
    q, k, v = qkv.view(b, s, 3, h, dim).permute(2, 0, 3, 1, 4).reshape(3, b * h, s, dim)
    want = reference(torch, q, k, v, scale, causal).view(b, h, s, dim).transpose(1, 2).reshape(b, s, h * dim)
    assert float((out.double() - want).abs().max()) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("make", [bert, llama], ids=["bert", "llama"])
def test_fp16_models_with_fused_attention_match_pytorch(make):
    torch = pytest.importorskip("torch")
    module, x = make(torch, seq=128)
    executable = tvm_ext.build(tvm_ext.from_torch(module, x), "cuda")
    assert any("attention" in k for k in tvm_ext.cuda_kernels(executable))
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    got = VirtualMachine(executable, tvm.cuda(0))["main"](tvm.runtime.tensor(x.numpy(), tvm.cuda(0)))
    got = (got[0] if not hasattr(got, "numpy") else got).numpy().astype("float32")
    with torch.no_grad():
        want = module.float()(x.float()).numpy()
    np.testing.assert_allclose(got, want, atol=3e-2)
