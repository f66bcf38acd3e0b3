"""Decoding steps' matmuls. A single row is a GEMV: on a GPU it reads the weight as stored, [n, k],
and dlight's GEMV rule builds it (warp reductions along k, the weight read once at bandwidth), not
16-row tensor-core tiles over a transposed weight (6x slower). A few rows (2 to 15) are padded to
one 16-row tile and split along k, as 16 rows are."""

import re

import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.spelled import main_module
from conftest import CUDA_TARGET


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
