"""Welford variance (the default) against TVM's two-pass legalization, on data far from zero."""

import re
import shutil
import warnings

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine
from tvm.support import nvcc

import tvm_ext
from conftest import CUDA_TARGET
from helpers import variance_module


def relative_error(algorithm, xs):
    ex = tvm_ext.build(variance_module(*xs.shape), "llvm", variance=algorithm)
    out = VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xs)).numpy()
    ref = xs.astype("float64").var(1)
    return float(np.max(np.abs(out - ref) / ref))


@pytest.mark.parametrize("width", [1024, 8192, 65536, 262144])
@pytest.mark.parametrize("mean", [0.0, 1e4])
def test_welford_meets_1e_6_where_one_pass_fails(width, mean, rng):
    # the bar: float32, normal(mean, 1), variance within 1e-6 of a float64 two-pass reference
    xs = (rng.standard_normal((2, width)) + mean).astype("float32")
    assert relative_error("welford", xs) <= 1e-6
    if mean:
        assert relative_error("one_pass", xs) > 1.0  # E[x^2]-E[x]^2 at mean 1e4: no digit left
    else:
        assert relative_error("one_pass", xs) < 1e-4  # fine near zero: the option computes what it says


def test_two_pass_in_float32_is_less_accurate_than_welford_far_from_zero(rng):
    xs = (rng.standard_normal((2, 262144)) + 1e4).astype("float32")
    assert relative_error("two_pass", xs) > 10 * relative_error("welford", xs)


def test_welford_variance_is_one_cuda_reduction_with_a_three_value_state():
    src = tvm_ext.cuda_source(tvm_ext.build(variance_module(256, 401408), CUDA_TARGET))
    two = tvm_ext.cuda_source(tvm_ext.build(variance_module(256, 401408), CUDA_TARGET, variance="two_pass"))
    assert src.count("__shfl_down_sync") == 3 * two.count("__shfl_down_sync") // 2, \
        "one cross-thread reduction of (count, mean, M2) in place of two of one value"


def test_unknown_variance_algorithm_is_named():
    with pytest.raises(ValueError, match="unknown variance algorithm 'three_pass'.*one_pass"):
        tvm_ext.build(variance_module(2, 8), "llvm", variance="three_pass")


@pytest.mark.parametrize("algorithm", ["welford", "one_pass"])
def test_each_one_pass_form_gets_our_cuda_schedule(algorithm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a reducer TVM cannot match would fall back with a warning
        src = tvm_ext.cuda_source(tvm_ext.build(variance_module(64, 8192), CUDA_TARGET, variance=algorithm))
    assert "__shfl_down_sync" in src


def test_serial_update_is_welfords_streaming_form_with_a_fast_reciprocal():
    src = tvm_ext.cuda_source(tvm_ext.build(variance_module(64, 8192), CUDA_TARGET))
    m2 = re.search(r"float v_welford_v0 = (.*);", src).group(1)
    # M2 + (x - mean) * (x - (mean + (x - mean) * r)): the new mean inside the second factor
    assert re.search(r"- \(in_thread_welford_v1\w*\[0\] \+ .*__fdividef\(", m2), m2
    assert "__fdividef(0x1p+0f" in src and not re.search(r"0x1p\+0f/\*1\.000000e\+00\*/ / max\(", src)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_welford_update_uses_one_fast_reciprocal_even_without_fast_math(monkeypatch):
    monkeypatch.setenv("TVM_CUDA_NVCC_NO_FAST_MATH", "1")
    target = tvm_ext.parse_target(CUDA_TARGET)
    src = tvm_ext.cuda_source(tvm_ext.build(variance_module(64, 8192), target))
    with target:
        ptx = bytes(nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc")).decode()
    # __fdividef(1, n) is PTX div.approx.f32 (one MUFU.RCP and a multiply); IEEE division is div.rn
    approximate, ieee = len(re.findall(r"\b(?:rcp|div)\.approx", ptx)), len(re.findall(r"\bdiv\.rn", ptx))
    assert approximate > 0 and ieee == 0, (approximate, ieee)


def test_bfloat16_variance_on_the_cpu_is_right(rng):
    # TVM's CPU bf16 legalization breaks multi-value reductions; bf16 statistics take two passes there
    import ml_dtypes  # noqa: PLC0415

    xs = rng.standard_normal((3, 256)).astype(ml_dtypes.bfloat16)
    got = VirtualMachine(tvm_ext.build(variance_module(3, 256, "bfloat16"), "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(xs)).numpy()
    np.testing.assert_allclose(got.astype("float64"), xs.astype("float64").var(1), rtol=2e-2)


def _residual_layer_norm(rows, hidden, dtype="float16"):
    """BERT's residual + LayerNorm: x and the residual, [rows, hidden], reshaped to [1, rows, hidden],
    added, normed over hidden with constant gamma and beta."""
    from tvm import relax  # noqa: PLC0415

    bb = relax.BlockBuilder()
    x, r = (relax.Var(name, relax.TensorType([rows, hidden], dtype)) for name in ("x", "r"))
    gamma = relax.const(np.linspace(0.5, 1.5, hidden).astype(dtype), dtype)
    beta = relax.const(np.linspace(-0.25, 0.25, hidden).astype(dtype), dtype)
    with bb.function("main", [x, r]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(bb.emit(relax.op.reshape(x, [1, rows, hidden])),
                                     bb.emit(relax.op.reshape(r, [1, rows, hidden]))))
            out = bb.emit_output(relax.op.nn.layer_norm(h, gamma, beta, axes=[-1], epsilon=1e-12))
        bb.emit_func_output(out)
    return bb.get(), np.linspace(0.5, 1.5, hidden), np.linspace(-0.25, 0.25, hidden)


@pytest.mark.parametrize("hidden", [128, 256, 768, 1024])
def test_residual_layer_norm_is_one_kernel_of_ours_on_cuda(hidden):
    # Both rows are staged. Two dynamic shared-memory stages made TVM's MergeSharedMemoryAllocations
    # run, and it rejects the let-bindings of Welford's fully unrolled update ("Load memory in places
    # other than store"): every BERT width fell back to TVM's schedule with a FallbackWarning.
    from tvm_ext.fallback import FallbackWarning  # noqa: PLC0415

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = tvm_ext.cuda_source(tvm_ext.build(_residual_layer_norm(64, hidden)[0], CUDA_TARGET))
    assert [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)] == []
    kernels = set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', src))
    assert len(kernels) == 1, kernels
    assert re.search(r"\bx_shared\w*_ptr\b", src) and re.search(r"\br_shared\w*_ptr\b", src), "both rows staged"
    assert src.count("extern __shared__") == 1, "one dynamic stage, the other static"


def test_residual_layer_norm_stages_past_48_kb_only_what_a_launch_takes_without_opting_in():
    # 8192 float32 columns, one row a block: x and the residual are 32 KB each. A static 32 KB beside
    # a dynamic 32 KB needs an opt-in that TVM's launch makes only for 48 KB of dynamic memory: the
    # residual is read from global memory instead.
    from tvm_ext.fallback import FallbackWarning  # noqa: PLC0415

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = tvm_ext.cuda_source(tvm_ext.build(_residual_layer_norm(64, 8192, "float32")[0], CUDA_TARGET))
    assert [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)] == []
    assert re.search(r"extern __shared__ __align__\(\d+\) float x_shared\w*_ptr\[\];", src)
    assert not re.search(r"\br_shared\w*_ptr\b", src)


@pytest.mark.parametrize("hidden, dtype", [(256, "float16"), (768, "float32")])
def test_residual_layer_norm_on_the_cpu_matches_numpy(hidden, dtype, rng):
    mod, gamma, beta = _residual_layer_norm(16, hidden, dtype)
    xs, rs = (rng.standard_normal((16, hidden)).astype(dtype) for _ in range(2))
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(xs), tvm.runtime.tensor(rs)).numpy()
    h = xs.astype("float64") + rs.astype("float64")
    if dtype == "float16":
        h = (xs + rs).astype("float64")  # the sum is taken in float16, as the model does
    ref = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-12)
    ref = ref * gamma.astype(dtype).astype("float64") + beta.astype(dtype).astype("float64")
    assert got.shape == (1, 16, hidden)
    np.testing.assert_allclose(got[0].astype("float64"), ref, atol={"float16": 1e-2, "float32": 2e-5}[dtype])
