"""Softmax with its statistics in one pass (tvm_ext/relax/online_softmax.py): the math on the CPU
(huge and -inf values, fp16), and which rows take it on CUDA: static rows larger than a block's
stage, not rows staged in shared memory (nor symbolic widths)."""

import numpy as np
import pytest
import tvm
from tvm import te

import tvm_ext
from bench.suite import relax_module
from tvm_ext.relax import online_softmax


def _softmax_on_cpu(x: np.ndarray, axis: int) -> np.ndarray:
    data = te.placeholder(x.shape, str(x.dtype), name="x")
    func = te.create_prim_func([data, online_softmax.softmax_te(data, axis)])
    built = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros_like(x))
    built["main"](tvm.runtime.tensor(x), out)
    return out.numpy()


def _reference(x: np.ndarray, axis: int) -> np.ndarray:
    x = x.astype("float64")
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis, keepdims=True))
        return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("axis", [-1, 1])
def test_online_softmax_matches_float64(axis, rng):
    x = (rng.standard_normal((3, 1000, 5)) * 30).astype("float32")
    x[0, :, 0] += 1e4  # far from zero: the rescaled sum must not overflow
    np.testing.assert_allclose(_softmax_on_cpu(x, axis), _reference(x, axis), rtol=2e-5, atol=1e-9)


def test_minus_infinity_is_zero_and_a_row_of_it_alone_is_nan_as_in_pytorch(rng):
    x = rng.standard_normal((4, 257)).astype("float32")
    x[0, ::2] = -np.inf  # a causal or padding mask written with -inf
    x[1, :200] = -np.inf
    x[2, :] = -np.inf
    got = _softmax_on_cpu(x, -1)
    np.testing.assert_allclose(got[[0, 1, 3]], _reference(x, -1)[[0, 1, 3]], rtol=2e-5, atol=1e-9)
    assert (got[0, ::2] == 0).all() and (got[1, :200] == 0).all()
    assert np.isnan(got[2]).all()


def test_half_input_accumulates_in_float32(rng):
    x = (rng.standard_normal((2, 32768)) * 4).astype("float16")
    got = _softmax_on_cpu(x, -1)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype("float64"), _reference(x, -1), rtol=2e-3, atol=1e-7)


CUDA = {"kind": "cuda", "arch": "sm_90a"}


@pytest.mark.parametrize("shape, dtype, online", [
    ([256, 262144], "float32", True),  # 1 MB rows: re-read
    ([512, 151936], "float16", True),  # 297 KB
    (["b", "s"], "float16", False),  # width classes: not staged, but the online form did not pay there
    ([1024, 50257], "float16", False),  # 100 KB: staged, max then sum from the stage
    ([8192, 4096], "float16", False),
    ([8, 131072], "float16", False),  # fewer rows than SMs: grid_sync stages each block's chunk
])
def test_rows_re_read_from_memory_take_the_online_statistics(shape, dtype, online):
    executable = tvm_ext.build(relax_module("softmax", shape, dtype), CUDA)
    src = tvm_ext.cuda_source(executable)
    assert ("softmax_state" in src) == online
    if online:  # one reduction of the (sum, max) state: one pass over x before the one that writes the output
        assert "T_softmax_maxelem" not in src and "T_softmax_expsum" not in src
        assert "softmax_state_v0" in src and "softmax_state_v1" in src
