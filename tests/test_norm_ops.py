"""std, training-mode batch norm and group norm: statistics in one Welford reduction, numbers as NumPy's."""

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from conftest import CUDA_TARGET

EPS = 1e-5


def module(op: str, shape: list, dtype: str = "float32"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    c = shape[1]
    params = [relax.Var(n, relax.TensorType([c], dtype)) for n in ("gamma", "beta", "mean", "var")]
    args = [x] + (params[:2] if op == "group_norm" else params if op == "batch_norm" else [])
    with bb.function("main", args):
        with bb.dataflow():
            if op == "std":
                out = relax.op.std(x, axis=[1], keepdims=True)
            elif op == "batch_norm":
                out = relax.op.nn.batch_norm(x, *params, axis=1, epsilon=EPS, training=True, momentum=0.1)
            else:
                out = relax.op.nn.group_norm(x, params[0], params[1], num_groups=4, channel_axis=1, axes=[2, 3],
                                             epsilon=EPS)
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def reference(op, x, gamma=None, beta=None, mean=None, var=None):
    x = x.astype("float64")
    if op == "std":
        return [x.std(1, keepdims=True)]
    if op == "batch_norm":
        m, v = x.mean((0, 2, 3)), x.var((0, 2, 3))
        y = (x - m[None, :, None, None]) / np.sqrt(v[None, :, None, None] + EPS) * gamma[None, :, None, None] \
            + beta[None, :, None, None]
        return [y, 0.9 * mean + 0.1 * m, 0.9 * var + 0.1 * v]
    n, c, h, w = x.shape
    g = x.reshape(n, 4, c // 4, h, w)
    y = (g - g.mean((2, 3, 4), keepdims=True)) / np.sqrt(g.var((2, 3, 4), keepdims=True) + EPS)
    return [y.reshape(x.shape) * gamma[None, :, None, None] + beta[None, :, None, None]]


CASES = [("std", [6, 3000]), ("batch_norm", [4, 8, 10, 12]), ("group_norm", [3, 16, 9, 11])]


@pytest.mark.parametrize("op, shape", CASES)
@pytest.mark.parametrize("variance", ["welford", "two_pass"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 2e-4), ("float64", 1e-11)])
def test_matches_numpy_on_llvm(op, shape, variance, dtype, tolerance, rng):
    """float64 too: its statistics were accumulated in float32 (errors of 1e-7 where NumPy's are 1e-15)."""
    x = (rng.standard_normal(shape) * 2 + 100).astype(dtype)  # far enough from zero to matter
    params = [rng.standard_normal(shape[1]).astype(dtype) for _ in range(2)] + [
        rng.standard_normal(shape[1]).astype(dtype), rng.random(shape[1]).astype(dtype)]
    args = [x] + (params[:2] if op == "group_norm" else params if op == "batch_norm" else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = tvm_ext.build(module(op, shape, dtype), "llvm", variance=variance)
    assert not [w for w in caught if "tvm_ext:" in str(w.message)], "our schedules serve both forms"
    out = VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    outs = [o.numpy() for o in out] if op == "batch_norm" else [out.numpy()]
    for got, want in zip(outs, reference(op, *args)):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("op, shape", CASES)
def test_statistics_are_one_welford_reduction_on_cuda(op, shape):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        welford = tvm_ext.cuda_source(tvm_ext.build(module(op, shape), CUDA_TARGET))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two_pass = tvm_ext.cuda_source(tvm_ext.build(module(op, shape), CUDA_TARGET, variance="two_pass"))
    assert "__fdividef(" in welford and "__fdividef(" not in two_pass  # the Welford reciprocal
