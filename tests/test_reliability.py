"""Inputs at the edges: NaN and Inf propagate as in PyTorch (IEEE arithmetic on the same formulas),
only through the rows that hold them; degenerate shapes (zero rows, one-element rows) build and run."""

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import input_shapes, reference, relax_module
from conftest import CUDA_TARGET

ROWS, WIDTH = 8, 256


def run(op: str, shape: list, arrays: list, target="llvm"):
    mod = relax_module(op, shape, "float32")
    out = VirtualMachine(tvm_ext.build(mod, target), tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return (out if hasattr(out, "numpy") else out[0]).numpy()


def inputs(op: str, shape: list, rng) -> list:
    return [rng.standard_normal(s).astype("float32") for s in input_shapes(op, shape)]


def expected(op: str, arrays: list):
    """PyTorch's definitions in float64 (bench.suite.reference), IEEE rules for NaN and Inf."""
    with np.errstate(all="ignore"):
        return reference(op, arrays)[0]


@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
def test_nan_and_inf_propagate_like_pytorch_and_stay_in_their_rows(op, rng):
    x, *params = inputs(op, [ROWS, WIDTH], rng)
    x[2, 5], x[5, 7], x[6, 3] = np.nan, np.inf, -np.inf
    got = run(op, [ROWS, WIDTH], [x, *params])
    want = expected(op, [x, *params])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)
    clean = [r for r in range(ROWS) if r not in (2, 5, 6)]
    assert np.isfinite(got[clean]).all()  # a bad value never leaks into another row


@pytest.mark.parametrize("op, shape", [("softmax", [0, 64]), ("layer_norm", [0, 64]), ("softmax", [3, 1]),
                                       ("layer_norm", [4, 1]), ("rms_norm", [1, 1]), ("rms_norm", [1, 64])])
def test_zero_and_one_sized_dims_build_and_match(op, shape, rng):
    arrays = inputs(op, shape, rng)
    tvm_ext.cuda_source(tvm_ext.build(relax_module(op, shape, "float32"), CUDA_TARGET))  # the CUDA build works too
    got = run(op, shape, arrays)
    assert got.shape == tuple(shape)
    np.testing.assert_allclose(got, expected(op, arrays), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exponent, products", [(2.0, True), (3.0, True), (0.5, False)])
def test_whole_powers_are_products_because_cuda_builds_use_fast_math(exponent, products, rng):
    """TVM builds CUDA with --use_fast_math, where powf(x, 2) is exp2(2 * log2(x)): NaN for x < 0.
    LLaMA's RMSNorm squares with pow, and every output of our LLaMA layer was NaN on the H200."""
    from tvm import relax  # noqa: PLC0415

    from bench.spelled import main_module  # noqa: PLC0415

    x = relax.Var("x", relax.TensorType([ROWS, WIDTH], "float32"))
    mod = main_module(lambda bb, x: relax.op.power(x, relax.const(exponent, "float32")), [x])
    source = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    assert ("powf" not in source) == products and "__global__" in source
    data = rng.standard_normal([ROWS, WIDTH]).astype("float32")
    data = np.abs(data) if exponent == 0.5 else data
    out = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(data))
    np.testing.assert_allclose((out if hasattr(out, "numpy") else out[0]).numpy(), data ** exponent, rtol=1e-6)


@pytest.mark.parametrize("op, shape", [("softmax", [ROWS, WIDTH]), ("layer_norm", [ROWS, WIDTH]),
                                       ("rms_norm", [ROWS, WIDTH]), ("bn_stats", [4, 3, 5, 6])])
def test_float64_is_computed_in_float64(op, shape, rng):
    """float64 inputs were rounded to float32 inside our legalizations (softmax rel. err. 4e-7) and
    TVM's rms_norm: on llvm they now match NumPy's float64 to ~1e-15, and the CUDA kernel has no float32."""
    arrays = [rng.standard_normal(s) * 2 + 0.5 for s in input_shapes(op, shape)]
    out = VirtualMachine(tvm_ext.build(relax_module(op, shape, "float64"), "llvm"), tvm.cpu())["main"](
        *map(tvm.runtime.tensor, arrays))
    got = [out] if hasattr(out, "numpy") else list(out)
    for g, want in zip(got, reference(op, arrays), strict=True):
        assert g.numpy().dtype == np.float64
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-12, atol=1e-13)
    source = tvm_ext.cuda_source(tvm_ext.build(relax_module(op, shape, "float64"), CUDA_TARGET))
    assert "double" in source and "float " not in source and "(float)" not in source


def test_slices_along_a_negative_axis_of_a_symbolic_shape_build_and_match(rng):
    """TVM's strided_slice legalization takes a negative axis only for static shapes ("Check failed:
    axis < src_tensor_dim"); GPT-2 built for any batch slices its position ids along dim -1."""
    from tvm import relax, tirx  # noqa: PLC0415

    from bench.spelled import main_module  # noqa: PLC0415

    x = relax.Var("x", relax.TensorType([tirx.Var("n", "int64"), WIDTH], "float32"))
    mod = main_module(lambda bb, x: relax.op.strided_slice(x, [-1], [1], [WIDTH - 3], [2]) * relax.const(2.0), [x])
    assert "__global__" in tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    data = rng.standard_normal([3, WIDTH]).astype("float32")
    out = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(data))
    np.testing.assert_array_equal(out.numpy(), data[:, 1:WIDTH - 3:2] * 2)
