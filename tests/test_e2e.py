"""Real PyTorch architectures end to end on the CPU: import, build, run, export, deploy.

Small twins of the benchmarked models (examples/torch_models.py), so the path a user takes is tested
here; the full sizes run on the GPU (bench/e2e.py). Needs PyTorch, an optional extra: without it
this module is skipped (CI's environment has none), and says so.
"""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from tvm_ext.fallback import FallbackWarning
from conftest import CUDA_TARGET

torch = pytest.importorskip("torch")
from examples.torch_models import DECODE_DYNAMIC, decode_inputs, make, make_decode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_model(executable, x, device=None):
    """The model's output as numpy, run on `device` (the CPU by default)."""
    device = device or tvm.cpu()
    out = VirtualMachine(executable, device)["main"](tvm.runtime.tensor(x.numpy(), device))
    return (out if hasattr(out, "numpy") else out[0]).numpy()


@pytest.mark.parametrize("name, reduce_kernels", [  # a layer's two norms share one kernel (same function)
    ("llama-tiny", {"power_mean": 1, "softmax": 1}),  # RMSNorm (statistics and weight) and softmax: one each
    ("bert-tiny", {"layer_norm": 1, "softmax": 1}),
    ("resnet-tiny-train-bn", {"instance_norm_statistics": 1}),  # batch statistics over (N, H, W) in one kernel
    ("resnet-tiny-folded-bn", {"statistics": 0})])
def test_model_matches_pytorch_and_its_norms_are_our_kernels(name, reduce_kernels):
    module, x = make(name)
    with torch.no_grad():
        want = module(x).numpy()
    mod = tvm_ext.from_torch(module, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fused function may fall back to TVM's schedules
        kernels = tvm_ext.cuda_kernels(tvm_ext.build(mod, CUDA_TARGET))
    for pattern, count in reduce_kernels.items():
        assert sum(pattern in k for k in kernels) == count, kernels
    np.testing.assert_allclose(run_model(tvm_ext.build(mod, "llvm"), x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_fp16_llama_layer_norms_are_one_kernel_each_with_their_statistics(arch):
    """The RMSNorm before the gated MLP writes its rows regrouped to [tokens, hidden] for the Linear:
    once it was split there, and its statistic, a kernel of its own, fell to TVM's default schedule
    (1.1 ms of a 0.4 ms LLaMA-7B layer on an H200). 8192 tokens: enough tiles for the gate and up
    projections to be joined into one gated Linear, the one consumer of the norm."""
    module, x = make("llama-tiny")
    mod = tvm_ext.from_torch(module.half(), torch.randn(1, 8192, x.shape[-1]).half())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fused function may fall back to TVM's schedules
        kernels = tvm_ext.cuda_kernels(tvm_ext.build(mod, {"kind": "cuda", "arch": arch}))
    norms = [k for k in kernels if "power_mean" in k]
    assert norms and all("rsqrt_multiply" in k for k in norms), kernels


def test_llama_with_symbolic_sequence_runs_every_length_from_one_build():
    module, x = make("llama-tiny")
    executable = tvm_ext.build(tvm_ext.from_torch(module, x, dynamic={0: {1: "seq"}}), "llvm")
    for n in (1, 7, 32, 45):
        xi = torch.randn(1, n, x.shape[-1])
        with torch.no_grad():
            want = module(xi).numpy()
        np.testing.assert_allclose(run_model(executable, xi), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["bert-tiny", "llama-tiny"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_fp16_layers_built_for_any_length_compile_to_cuda(name, arch):
    """Every kernel through CUDA codegen (which the fallback does not cover): 8-lane half vectors
    of the elementwise rule at a symbolic length once failed it for BERT's packed projection. No
    function falls back: BERT's LayerNorm over [2, seq] and softmax over [2, heads, seq, seq] once
    did (blocks of rows crossing a symbolic row dim)."""
    module, x = make(name)
    mod = tvm_ext.from_torch(module.half(), x.half(), dynamic={0: {1: ("seq", 1, 512)}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = tvm_ext.cuda_source(tvm_ext.build(mod, {"kind": "cuda", "arch": arch}))
    assert source.count("__global__") >= 10
    assert not [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def test_a_length_outside_the_declared_range_is_a_clear_error_before_any_kernel():
    """TVM plans memory for the declared bound (tir_var_upper_bound): past it, kernels would write
    past their buffers."""
    module, x = make("llama-tiny")
    executable = tvm_ext.build(tvm_ext.from_torch(module, x, dynamic={0: {1: ("seq", 2, 40)}}), "llvm")
    xi = torch.randn(1, 40, x.shape[-1])
    with torch.no_grad():
        np.testing.assert_allclose(run_model(executable, xi), module(xi).numpy(), rtol=1e-4, atol=1e-4)
    for n in (1, 41):
        with pytest.raises(AssertionError, match=rf"input 0 dim 1 \('seq'\) is {n}, outside the range \[2, 40\]"):
            run_model(executable, torch.randn(1, n, x.shape[-1]))


def test_decode_layer_with_a_kv_cache_runs_any_batch_and_cache_length_from_one_build():
    """The cache grows by a concat to `past + 1`, a length no input has: kernels that take it as a
    scalar once joined into a group that left it undefined, and the build failed."""
    module, inputs = make_decode("llama-decode-tiny", batch=2, past=37)
    mod = tvm_ext.from_torch(module, *inputs, dynamic=DECODE_DYNAMIC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fused function may fall back to TVM's schedules
        assert tvm_ext.cuda_kernels(tvm_ext.build(mod, CUDA_TARGET))
    vm = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    for batch, past in ((1, 1), (3, 100), (2, 37)):
        inputs = decode_inputs(module, batch, past, torch.float32)
        with torch.no_grad():
            want = module(*inputs)
        got = vm["main"](*(tvm.runtime.tensor(t.numpy()) for t in inputs))
        assert len(got) == 3 and got[1].shape == (batch, 2, past + 1, 64)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-4)


def test_an_op_the_frontend_cannot_import_is_named():
    class Bessel(torch.nn.Module):
        def forward(self, x):
            return torch.special.i0(x).softmax(-1)

    with pytest.raises(tvm_ext.UnsupportedOperatorError, match="i0.default") as err:
        tvm_ext.from_torch(Bessel(), torch.randn(4, 8))
    assert err.value.ops == ["i0.default"]


def test_deploy_demo_runs_the_exported_model_with_the_runtime_alone(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "deploy_demo.py"), "--model", "bert-tiny",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "runtime-only run" in done.stdout and (tmp_path / "bert-tiny.so").is_file()
    error = float(done.stdout.split("max abs error ")[1].split()[0])
    assert error < 1e-4


def test_fp16_model_imports_with_fp16_matmul_outputs():
    """TVM 0.27's converters make every matmul float32; an fp16 BERT layer then failed to import
    (bias add of mixed dtypes). Ours round the float32 product to fp16, as PyTorch does."""
    module, x = make("bert-tiny")
    with torch.no_grad():
        want = module(x).numpy()
    mod = tvm_ext.from_torch(module.half(), x.half())
    got = run_model(tvm_ext.build(mod, "llvm"), x.half())
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype("float32"), want, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", [("llama-tiny", torch.float32), ("llama-tiny", torch.float16),
                                         ("bert-tiny", torch.float16), ("resnet-tiny-train-bn", torch.float32)])
def test_models_on_the_gpu_match_pytorch(name, dtype):
    """On the H200 our LLaMA layer (llama-seq512) returned NaN while the CPU build was right: this
    runs the small twins on the GPU, where the cause can be bisected kernel by kernel."""
    module, x = make(name)
    module, x = module.to(dtype), x.to(dtype)
    mod = tvm_ext.from_torch(module, x)
    gpu = tvm_ext.build(mod, "cuda")
    got = run_model(gpu, x, tvm.cuda(0)).astype("float32")
    with torch.no_grad():
        want = module.float()(x.float()).numpy()
    tolerance = 3e-2 if dtype == torch.float16 else 1e-3
    if np.isnan(got).any() or not np.allclose(got, want, atol=tolerance):
        inputs = [x.float().numpy().astype(str(x.dtype).removeprefix("torch."))]
        where = tvm_ext.first_divergent_call(tvm_ext.trace_calls(gpu, tvm.cuda(0), *inputs),
                                             tvm_ext.trace_calls(tvm_ext.build(mod, "llvm"), tvm.cpu(), *inputs),
                                             rtol=tolerance, atol=tolerance)
        pytest.fail(f"GPU output differs from PyTorch; first kernel that differs from the CPU build: {where}")


@pytest.mark.gpu
def test_fp16_bert_built_for_any_length_matches_pytorch_on_the_gpu_at_several():
    """Its LayerNorm rows are [2, seq] and its softmax rows [2, heads, seq, seq]: blocks of several
    rows cross from one batch entry or head to the next at lengths no block size divides."""
    module, x = make("bert-tiny")
    module = module.half()
    mod = tvm_ext.from_torch(module, x.half(), dynamic={0: {1: ("seq", 1, 512)}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fused function may fall back to TVM's schedules
        executable = tvm_ext.build(mod, "cuda")
    for n in (1, 7, 77, 200):
        xi = torch.randn(x.shape[0], n, x.shape[-1]).half()
        with torch.no_grad():
            want = module.float()(xi.float()).numpy()
        np.testing.assert_allclose(run_model(executable, xi, tvm.cuda(0)).astype("float32"), want, atol=3e-2,
                                   err_msg=f"seq {n}")


def test_call_traces_name_the_first_kernel_that_differs():
    module, x = make("llama-tiny")
    executable = tvm_ext.build(tvm_ext.from_torch(module, x), "llvm")
    trace = tvm_ext.trace_calls(executable, tvm.cpu(), x.numpy())
    assert len(trace) > 10 and tvm_ext.first_divergent_call(trace, trace) is None
    index, (name, tensors) = next((i, c) for i, c in enumerate(trace) if "softmax" in c[0])
    broken = [*trace[:index], (name, [*tensors[:-1], np.full_like(tensors[-1], np.nan)]), *trace[index + 1:]]
    found = tvm_ext.first_divergent_call(broken, trace)
    assert found.startswith(f"call {index}: {name}, argument {len(tensors) - 1}") and "more NaN" in found
