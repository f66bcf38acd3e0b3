"""Inputs at the edges: NaN and Inf propagate as in PyTorch (IEEE arithmetic on the same formulas),
only through the rows that hold them; degenerate shapes (zero rows, one-element rows) build and run."""

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET

ROWS, WIDTH = 8, 256


def reference(op: str, x, *params):
    """PyTorch's definitions in float64 numpy (torch.softmax, F.layer_norm, LLaMA's RMSNorm)."""
    with np.errstate(all="ignore"):
        if op == "softmax":
            e = np.exp(x - x.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)
        if op == "layer_norm":
            mean = x.mean(-1, keepdims=True)
            return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * params[0] + params[1]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * params[0]


def run(op: str, shape: list, arrays: list, target="llvm"):
    mod = relax_module(op, shape, "float32")
    out = VirtualMachine(tvm_ext.build(mod, target), tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return (out if hasattr(out, "numpy") else out[0]).numpy()


@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
def test_nan_and_inf_propagate_like_pytorch_and_stay_in_their_rows(op, rng):
    x = rng.standard_normal((ROWS, WIDTH)).astype("float32")
    x[2, 5], x[5, 7], x[6, 3] = np.nan, np.inf, -np.inf
    params = [rng.standard_normal(WIDTH).astype("float32") for _ in range({"softmax": 0, "layer_norm": 2}.get(op, 1))]
    got = run(op, [ROWS, WIDTH], [x, *params])
    want = reference(op, x.astype("float64"), *[p.astype("float64") for p in params])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)
    clean = [r for r in range(ROWS) if r not in (2, 5, 6)]
    assert np.isfinite(got[clean]).all()  # a bad value never leaks into another row


@pytest.mark.parametrize("op, shape", [("softmax", [0, 64]), ("layer_norm", [0, 64]), ("softmax", [3, 1]),
                                       ("layer_norm", [4, 1]), ("rms_norm", [1, 1]), ("rms_norm", [1, 64])])
def test_zero_and_one_sized_dims_build_and_match(op, shape, rng):
    x = rng.standard_normal(shape).astype("float32")
    params = [rng.standard_normal(shape[-1]).astype("float32") for _ in range({"softmax": 0, "layer_norm": 2}.get(op, 1))]
    tvm_ext.cuda_source(tvm_ext.build(relax_module(op, shape, "float32"), CUDA_TARGET))  # the CUDA build works too
    got = run(op, shape, [x, *params])
    assert got.shape == tuple(shape)
    np.testing.assert_allclose(got, reference(op, x.astype("float64"), *[p.astype("float64") for p in params]),
                               rtol=1e-4, atol=1e-5)
