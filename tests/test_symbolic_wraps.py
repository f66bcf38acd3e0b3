"""Index wraps of symbolic reshapes (tvm_ext/tir/symbolic_wraps.py): `x[(... + i) % s]` read as
`x[i]` where i lies in [0, s), so that FuseOps fuses across a reshape at a symbolic size (a slice
of a joined matmul's output into its reader, not a kernel of its own)."""

import re
import warnings

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.spelled import main_module
from helpers import kernel_bodies
from tvm_ext.tir.symbolic_wraps import drop_wraps

OPAQUE = 8  # AnnotateTIROpPattern's kOpaque


def op_pattern(func: tirx.PrimFunc) -> int:
    mod = relax.transform.AnnotateTIROpPattern()(tvm.IRModule({"f": func}))
    return int(mod["f"].attrs["op_pattern"])


def test_a_symbolic_reshape_reads_its_rows_as_they_are_and_is_no_longer_opaque():
    m = tirx.Var("m", "int64")
    x = te.placeholder((m, 512), "float16", name="x")
    func = te.create_prim_func([x, tvm.topi.reshape(x, [m, 1, 4, 128])])
    assert op_pattern(func) == OPAQUE and "% m" in func.script()
    plain = drop_wraps(func)
    assert "%" not in plain.script() and "//" not in plain.script()
    assert op_pattern(plain) < OPAQUE


def test_a_reshape_into_a_leading_axis_of_one_reads_its_rows_without_the_symbolic_size():
    """[m, 512] to [1, m, 4, 128] reads x[0 + v0 * m + v1, ...] with v0 in [0, 1): a load naming m,
    which the store does not index, is opaque to AnnotateTIROpPattern."""
    m = tirx.Var("m", "int64")
    x = te.placeholder((m, 512), "float16", name="x")
    func = te.create_prim_func([x, tvm.topi.reshape(x, [1, m, 4, 128])])
    assert op_pattern(func) == OPAQUE
    plain = drop_wraps(func)
    assert op_pattern(plain) < OPAQUE
    assert "* m" not in plain.script().split("T.writes")[1], plain.script()


def test_a_wrap_that_can_wrap_stays():
    m = tirx.Var("m", "int64")
    x = te.placeholder((m, 4), "float16", name="x")
    func = te.create_prim_func([x, te.compute((m, 4), lambda i, j: x[(i + 1) % m, j], name="rolled")])
    assert drop_wraps(func).same_as(func)


def test_slices_of_a_joined_symbolic_matmul_are_fused_into_their_readers():
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((64, 32)) / 8).astype("float16") for _ in range(2)]
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType([m, 1, 32], "float16"))

    def body(bb, x):
        outs = []
        for weight in weights:
            rows = bb.emit(relax.op.reshape(x, [m, 32]))
            y = bb.emit(relax.op.matmul(rows, bb.emit(relax.op.permute_dims(relax.const(weight), [1, 0])), out_dtype="float32"))
            outs.append(bb.emit(relax.op.reshape(bb.emit(relax.op.astype(y, "float16")), [m, 1, 64])))
        return relax.op.multiply(outs[0], outs[1])

    mod = main_module(body, [x])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rewrite of ours falls back (the gated-epilogue fusion once read a symbolic dim as an int)
        kernels = list(kernel_bodies(tvm_ext.cuda_source(tvm_ext.build(mod, {"kind": "cuda", "arch": "sm_90a"}))))
    assert sum("matmul" in k for k in kernels) >= 1 and not any(re.match(r"strided_slice\d*_", k) for k in kernels), kernels
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(xs := rng.standard_normal((3, 1, 32)).astype("float16"))).numpy()
    want = np.prod([xs.astype("float32") @ w.astype("float32").T for w in weights], axis=0)
    np.testing.assert_allclose(got.astype("float32"), want, atol=2e-2 * np.abs(want).max())
