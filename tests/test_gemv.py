"""A single-row matmul (a decoding step's Linear) is a GEMV: on a GPU it reads the weight as stored,
[n, k], and dlight's GEMV rule builds it (warp reductions along k, the weight read once at
bandwidth), not 16-row tensor-core tiles over a transposed weight (6x slower)."""

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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 768), (11008, 4096)])
def test_a_single_row_linear_matches_numpy_on_gpu(n, k, dtype, rng):
    mod, weight, bias = linear(1, n, k, dtype)
    x = rng.standard_normal((1, k)).astype(dtype)
    got = VirtualMachine(tvm_ext.build(mod, "cuda"), tvm.cuda())["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
    want = x.astype("float32") @ weight.astype("float32").T + bias.astype("float32")
    tolerance = 1e-2 if dtype == "float16" else 6e-2
    np.testing.assert_allclose(got.astype("float32"), want, atol=tolerance * np.abs(want).max(), rtol=0)
