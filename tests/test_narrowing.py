"""int64 -> int32 index narrowing: static kernels narrowed when safe, symbolic ones built twice."""

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.runtime.vm import VirtualMachine

import tvm_ext
import tvm_ext.tir.narrowing as narrowing
from bench.suite import relax_module
from conftest import CUDA_TARGET
from tvm_ext.pipeline import fused_reduce_functions


def kernel_bodies(src: str) -> list[str]:
    return re.findall(r'extern "C" __global__ void [^;{]*\{(.*?)\n\}', src, re.S)


def called(vm, prefix, *args) -> list[str]:
    """The functions named `prefix`... that one call of `main` ran, in order (the VM's instrument hook)."""
    names = []

    def instrument(func, symbol, before, ret, *rest):
        if before and str(symbol).startswith(prefix):
            names.append(str(symbol))
        return 0

    vm.set_instrument(tvm_ffi.convert(instrument))
    vm["main"](*args)
    return names


def test_static_small_kernel_has_no_64_bit_index_arithmetic():
    src = tvm_ext.cuda_source(tvm_ext.build(relax_module("layer_norm", [4096, 1024], "float16"), CUDA_TARGET))
    assert kernel_bodies(src) and all("int64_t" not in body for body in kernel_bodies(src))


def test_static_huge_kernel_keeps_int64():
    # 2 x 1.2e9 fp16 (4.8 GB): element offsets pass 2^31
    src = tvm_ext.cuda_source(tvm_ext.build(relax_module("row_sum", [2, 1_200_000_000], "float16"), CUDA_TARGET))
    assert any("int64_t" in body for body in kernel_bodies(src))


def test_symbolic_kernel_is_built_twice_and_chosen_on_the_element_count():
    ex = tvm_ext.build(relax_module("layer_norm", ["n", 4096], "float16"), CUDA_TARGET)
    # two classes of row counts (fewer than the SMs, the rest: dispatch.few_rows_class), each twice
    assert tvm_ext.cuda_kernels(ex) == [f"layer_norm_v{i}{s}_kernel" for i in range(2) for s in ("_i32", "")]
    host = ex.as_text()
    assert host.count("If    ") == 3
    assert all(host.index(f"call  layer_norm_v{i}_i32 ") < host.index(f"call  layer_norm_v{i} ") for i in range(2))
    (func,) = fused_reduce_functions(relax_module("layer_norm", ["n", 4096], "float16"),
                                     tvm_ext.parse_target(CUDA_TARGET)).values()
    condition = narrowing.narrow_condition(func)
    found = []
    tvm_ffi.structural_walk(condition, (tirx.Var, found.append), order="post")
    n = found[0]
    at = lambda value: tvm.sym.Analyzer().simplify(  # noqa: E731
        tvm_ffi.structural_map(condition, (tirx.Var, lambda v: tirx.const(value, v.ty.dtype) if v.same_as(n) else v)))
    assert at(2**31 // 4096 - 1).value and not at(2**31 // 4096).value  # n * 4096 < 2^31


def test_an_integer_scalar_no_buffer_bounds_is_checked_too():
    """A rotary angle's positions start at the cache's length, a scalar no buffer of the kernel bounds:
    the int32 twin runs only while the scalar fits too."""
    n, start = tirx.Var("n", "int64"), tirx.Var("start", "int64")
    positions = tvm.te.compute((n,), lambda i: (i + start).astype("float32"), name="positions")
    condition = narrowing.narrow_condition(tvm.te.create_prim_func([positions, start]))
    at = lambda n_value, start_value: tvm.sym.Analyzer().simplify(tvm_ffi.structural_map(  # noqa: E731
        condition, (tirx.Var, lambda v: tirx.const({"n": n_value, "start": start_value}[v.name], "int64"))))
    assert at(10, 2**31 - 1).value and not at(10, 2**31).value


@pytest.mark.parametrize("rows, expected", [(3, "softmax_i32"), (9, "softmax")])
def test_both_versions_run_and_agree_on_the_cpu(monkeypatch, rows, expected, rng):
    # a limit of 8 rows of 300 stands in for 2^31 so that both sides run here
    monkeypatch.setattr(narrowing, "LIMIT", 8 * 300)
    vm = VirtualMachine(tvm_ext.build(relax_module("softmax", ["n", 300], "float32"), "llvm"), tvm.cpu())
    x = rng.standard_normal((rows, 300)).astype("float32")
    assert called(vm, "softmax", tvm.runtime.tensor(x)) == [expected]
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-5)


def test_kernels_with_integer_tensors_keep_int64():
    # TVM's rewrite would narrow argmax's int64 output too; such kernels are left alone
    from patterns import module  # noqa: PLC0415

    src = tvm_ext.cuda_source(tvm_ext.build(module("argmax_rows"), CUDA_TARGET))
    assert "int64_t* __restrict__" in src


@pytest.mark.gpu
def test_more_than_2_31_elements_reduce_right_through_int64_on_gpu():
    # 2 x 1.2e9 fp16, zero but for marks that only an index past 2^31 reaches (row 1 starts at 1.2e9)
    x = np.zeros((2, 1_200_000_000), "float16")
    x[0, -7:], x[1, 1_100_000_000:1_100_001_000] = 1, 1
    vm = VirtualMachine(tvm_ext.build(relax_module("row_sum", list(x.shape), "float16"), "cuda"), tvm.cuda(0))
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x, tvm.cuda(0))).numpy(), [7, 1000])


@pytest.mark.gpu
def test_symbolic_rows_run_int32_when_small_and_int64_when_large_on_gpu():
    width = 4096  # int32 up to 524288 rows
    vm = VirtualMachine(tvm_ext.build(relax_module("row_sum", ["n", width], "float16"), "cuda"), tvm.cuda(0))
    for rows, narrow in ((1000, True), (600_000, False)):  # 600000 x 4096 = 2.46e9 elements
        values = (np.arange(rows) % 7 + 1).astype("float16")  # row r sums to (r % 7 + 1) * 4096, exact in fp16
        arg = tvm.runtime.tensor(np.ascontiguousarray(np.broadcast_to(values[:, None], (rows, width))), tvm.cuda(0))
        (kernel,) = called(vm, "fused_cast_sum", arg)  # fp16 sums accumulate in float32 (half_math.py)
        assert kernel.endswith(narrowing.SUFFIX) == narrow, kernel
        np.testing.assert_array_equal(vm["main"](arg).numpy(), values * width)
        del arg


def test_narrowing_can_be_switched_off_and_the_option_is_checked():
    ex = tvm_ext.build(relax_module("layer_norm", ["n", 4096], "float16"), CUDA_TARGET, narrow_index=False)
    assert tvm_ext.cuda_kernels(ex) == ["layer_norm_v0_kernel", "layer_norm_v1_kernel"]  # no int32 twins
    with pytest.raises(ValueError, match="narrow_index must be True or False, not 'yes'"):
        tvm_ext.build(relax_module("layer_norm", ["n", 4096], "float16"), CUDA_TARGET, narrow_index="yes")


def test_tvm_tensor_core_matmuls_keep_int64_and_build():
    """TVM's int32 rewrite broke dlight's WMMA matmuls (int64 vs int32 in the fragment offsets): an
    fp16 LLaMA layer failed to build. Only our own kernels are narrowed now."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([512, 256], "float16"))
    w = relax.Var("w", relax.TensorType([256, 256], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.astype(relax.op.matmul(x, w, out_dtype="float32"), "float16"))
            out = bb.emit_output(relax.op.nn.softmax(y, axis=-1))
        bb.emit_func_output(out)
    executable = tvm_ext.build(bb.get(), CUDA_TARGET)
    assert "wmma::mma_sync" in tvm_ext.cuda_source(executable)
    assert any("matmul" in k for k in tvm_ext.cuda_kernels(executable))


def test_dims_passed_together_as_one_shape_bind_each_scalar_parameter():
    # FuseOps passes the dims no operand's shape defines as one shape argument; the conditions of a
    # kernel's variants are over its scalar parameters, one for each value of that shape
    from tvm.script import tirx as T  # noqa: PLC0415
    from tvm_ext.relax.variants import _shape_bindings  # noqa: PLC0415

    @T.prim_func(private=True)
    def take(x: T.handle, lo: T.int64, hi: T.int64, y: T.handle):
        n = T.int64()
        X = T.match_buffer(x, (n,), "float32")
        Y = T.match_buffer(y, (hi - lo,), "float32")
        for i in range(hi - lo):
            Y[i] = X[lo + i]

    n, a, b = (tirx.Var(name, "int64") for name in "nab")
    x = relax.Var("x", relax.TensorType([n], "float32"))
    call = relax.call_tir(relax.GlobalVar("take"), [x, relax.ShapeExpr([a + 1, b * 2])],
                          relax.TensorType([b * 2 - a - 1], "float32"))
    bindings = {var.name: value for var, value in _shape_bindings(take, call).items()}
    assert set(bindings) == {"n", "lo", "hi"}
    tvm.ir.assert_structural_equal(bindings["lo"], a + 1)
    tvm.ir.assert_structural_equal(bindings["hi"], b * 2)
    tvm.ir.assert_structural_equal(bindings["n"], n)
