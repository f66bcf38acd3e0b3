"""Decoding steps' matmuls. A single row is a GEMV: on a GPU it reads the weight as stored, [n, k],
and our GEMV template builds it (schedules/gemv.py: 16 bytes a lane, several loads in flight, the
weight read once at bandwidth), not 16-row tensor-core tiles over a transposed weight (6x slower);
dlight's GEMV rule where k is not a whole number of 16-byte loads. A few rows (2 to 15) are padded
to one 16-row tile and split along k, as 16 rows are."""

import re
import warnings

import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.spelled import main_module
from conftest import CUDA_TARGET
from helpers import kernel_bodies
from test_few_row_matmul import matmul_func
from tvm_ext.pipeline import fused_module
from tvm_ext.schedules import contraction_template, gemv


def linear(rows, n, k, dtype, seed=0):
    """(module of x @ W^T + bias with W [n, k] a constant as torch.nn.Linear keeps it, W, bias)."""
    rng = np.random.default_rng(seed)
    weight, bias = (rng.standard_normal((n, k)) / 16).astype(dtype), rng.standard_normal(n).astype(dtype)
    x = relax.Var("x", relax.TensorType([rows, k], dtype))

    def body(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(relax.const(weight)), out_dtype="float32"))
        return relax.op.add(relax.op.astype(y, dtype), relax.const(bias))

    return main_module(body, [x]), weight, bias


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_single_row_linear_is_a_gemv_on_the_weight_as_stored(arch, dtype):
    executable = tvm_ext.build(linear(1, 512, 256, dtype)[0], {**CUDA_TARGET, "arch": arch})
    (kernel,) = tvm_ext.cuda_kernels(executable)
    src = tvm_ext.cuda_source(executable)
    assert kernel.startswith("fused_matmul_nt") and "add" in kernel  # W read as stored, the bias in its epilogue
    assert "__shfl" in src and "mma" not in src


def the_matmul(mod, target):
    """The fused matmul function of `mod` as the pipeline hands it to the templates."""
    (func,) = [f for gv, f in fused_module(mod, target).functions_items() if "matmul" in gv.name_hint]
    return func


@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 4104)])
def test_a_single_row_linear_is_our_gemv_reading_16_bytes_a_lane(n, k):
    """Also where k is a whole number of 16-byte loads but not of a warp's (4104: lanes past k)."""
    mod, target = linear(1, n, k, "float16")[0], tvm_ext.parse_target({**CUDA_TARGET, "arch": "sm_90a"})
    assert contraction_template(the_matmul(mod, target), target) is gemv
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        (body,) = kernel_bodies(tvm_ext.cuda_source(tvm_ext.build(mod, target))).values()
    assert "uint4" in body and "half2*" not in body and "threadIdx.y" not in body  # dlight's: 4-byte loads of W, 2-D blocks


def test_a_single_row_of_a_k_not_in_16_byte_loads_is_dlights_gemv():
    mod, target = linear(1, 512, 260, "float16")[0], tvm_ext.parse_target({**CUDA_TARGET, "arch": "sm_90a"})
    assert not gemv.fits(the_matmul(mod, target))
    (body,) = kernel_bodies(tvm_ext.cuda_source(tvm_ext.build(mod, target))).values()
    assert "__shfl" in body and "mma" not in body


def test_the_heuristic_takes_more_rows_a_warp_over_a_long_k_and_fewer_for_a_narrow_weight():
    points = {shape: gemv.heuristic(matmul_func(*shape, rows=1), 132)[0] for shape in [(4096, 4096), (4096, 11008), (896, 896)]}
    assert [points[s]["rows"] for s in [(4096, 4096), (4096, 11008), (896, 896)]] == [2, 4, 1]
    assert all(p in gemv.knob_space(matmul_func(*s, rows=1)) for s, p in points.items())


def test_more_rows_keep_the_tensor_cores():
    src = tvm_ext.cuda_source(tvm_ext.build(linear(32, 512, 256, "float16")[0], {**CUDA_TARGET, "arch": "sm_80"}))
    assert re.search(r"mma|wmma", src)


@pytest.mark.parametrize("rows", [2, 7, 15])
def test_a_few_rows_are_padded_to_a_tile_and_split_along_k(rows):
    executable = tvm_ext.build(linear(rows, 4096, 4096, "float16")[0], {**CUDA_TARGET, "arch": "sm_90a"})
    kernels = tvm_ext.cuda_kernels(executable)
    assert any("split_k_pad" in k for k in kernels) and any(k.startswith("matmul_split_k") for k in kernels), kernels
    assert re.search(r"mma|wmma", tvm_ext.cuda_source(executable))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows, n, k", [(1, 4096, 4096), (1, 1000, 768), (1, 11008, 4096), (2, 4096, 4096),
                                        (7, 4096, 11008), (15, 1024, 4096)])
def test_a_decoding_linear_matches_numpy_on_gpu(rows, n, k, dtype, rng):
    mod, weight, bias = linear(rows, n, k, dtype)
    x = rng.standard_normal((rows, k)).astype(dtype)
    got = VirtualMachine(tvm_ext.build(mod, "cuda"), tvm.cuda())["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
    want = x.astype("float32") @ weight.astype("float32").T + bias.astype("float32")
    tolerance = 1e-2 if dtype == "float16" else 6e-2
    np.testing.assert_allclose(got.astype("float32"), want, atol=tolerance * np.abs(want).max(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n, k, epilogue, every_point", [(1000, 4104, "residual", True), (4096, 4096, "cast", False),
                                                         (264, 11008, "none", False)])
def test_the_gemv_kernels_match_numpy_on_gpu(n, k, epilogue, every_point, dtype, rng):
    """Every knob point at an edge case (n not a multiple of any row group, k of a warp's loads:
    lanes past k); the heuristic's point elsewhere."""
    func = matmul_func(n, k, dtype, rows=1, epilogue=epilogue)
    weight = (rng.standard_normal((n, k)) / 16).astype(dtype)
    x, res = rng.standard_normal((1, k)).astype(dtype), rng.standard_normal((1, n)).astype(dtype)
    want = x.astype("float32") @ weight.astype("float32").T + (res.astype("float32") if epilogue == "residual" else 0)
    points = gemv.knob_space(func) if every_point and dtype == "float16" else [gemv.heuristic(func, 132)[0]]
    dev = tvm.cuda()
    for knobs in points:
        lib = tvm.compile(tvm.IRModule({"mm": gemv.apply(func, knobs).mod["main"].with_attr("global_symbol", "mm")}),
                          target="cuda")
        args = [x, weight] + ([res] if epilogue == "residual" else []) + [np.zeros((1, n), "float32" if epilogue == "none" else dtype)]
        args = [tvm.runtime.tensor(a, dev) for a in args]
        lib["mm"](*args)
        tolerance = 1e-2 if dtype == "float16" else 6e-2
        np.testing.assert_allclose(args[-1].numpy().astype("float32"), want, atol=tolerance * np.abs(want).max(), rtol=0,
                                   err_msg=str(knobs))
