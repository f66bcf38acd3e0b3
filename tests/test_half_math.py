"""Half arithmetic around reductions runs in float32 with PyTorch eager's rounding points."""

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench import spelled
from conftest import CUDA_TARGET
from tvm_ext.relax.half_math import half_math_in_float


def _module(body, shapes: list, dtype: str = "float16") -> tvm.IRModule:
    return spelled.main_module(body, [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)])


def _run_llvm(mod, *arrays) -> np.ndarray:
    vm = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def test_half_mean_accumulates_in_float32():
    """65536 fp16 ones: an fp16 accumulator passes 65504 (inf); PyTorch accumulates in float32: 1."""
    mod = _module(lambda bb, x: relax.op.mean(x, axis=[-1], keepdims=True), [[2, 65536]])
    got = _run_llvm(mod, np.ones([2, 65536], "float16"))
    np.testing.assert_array_equal(got, np.ones([2, 1], "float16"))


def test_spelled_half_softmax_is_float32_math_in_the_kernel():
    cuda = tvm_ext.cuda_source(tvm_ext.build(spelled.module("softmax_spelled", [256, 1024], "float16"), CUDA_TARGET))
    kernel = cuda[cuda.index("__global__"):]
    assert "hexp(" not in kernel and "expf(" in kernel
    assert "float in_thread" in kernel.replace("alignas(64) ", "")  # the row sum's accumulator


def _eager_softmax(x: np.ndarray) -> np.ndarray:
    """PyTorch eager on fp16: each op in float32, its result rounded to fp16; sum accumulates in float32."""
    def r(a):
        return a.astype("float16").astype("float32")
    xf = x.astype("float32")
    e = r(np.exp(r(xf - xf.max(-1, keepdims=True))))
    return r(e / r(e.sum(-1, keepdims=True)))


def test_spelled_half_softmax_rounds_per_op_like_eager(rng):
    x = (3 * rng.standard_normal([33, 700])).astype("float16")
    got = _run_llvm(spelled.module("softmax_spelled", list(x.shape), "float16"), x).astype("float32")
    want = _eager_softmax(x)
    ulp = np.spacing(want.astype("float16")).astype("float32")
    assert np.all(np.abs(got - want) <= ulp), np.max(np.abs(got - want) / ulp)


def test_matmul_keeps_its_half_inputs_and_the_reduction_after_it_is_float32():
    def body(bb, a, b):
        y = bb.emit(relax.op.matmul(a, b))
        return relax.op.sum(relax.op.exp(y), axis=[-1], keepdims=True)

    mod = half_math_in_float(_module(body, [[64, 32], [32, 48]]))
    calls = {b.value.op.name: b.value for b in mod["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)}
    assert [a.ty.dtype for a in calls["relax.matmul"].args] == ["float16", "float16"]
    assert calls["relax.exp"].args[0].ty.dtype == "float32"
    assert calls["relax.sum"].ty.dtype == "float32"


def test_a_module_without_half_reductions_is_unchanged():
    mod = _module(lambda bb, x: relax.op.exp(relax.op.add(x, x)), [[8, 8]])
    assert tvm_ffi.structural_equal(half_math_in_float(mod), mod)
