"""Welford variance: one pass over x with a (M2, mean, count) state, stable where E[x^2]-E[x]^2 is not.

TVM legalizes `relax.variance` in two passes (mean, then the sum of squared deviations), so x
crosses memory twice. Here it is one reduction whose combine rule is the parallel Welford update

    n = n_a + n_b;  mean = mean_a + (mean_b - mean_a) * n_b / n;
    M2 = M2_a + M2_b + (mean_b - mean_a)^2 * n_a * n_b / n

registered with TVM's schedule so that cross-thread (and rfactor) reductions accept it.

The state is ordered (M2, mean, count): TVM 0.27's warp-shuffle all-reduce updates the
components one after another in place, so each must only need the ones updated after it (seen:
(count, mean, M2) ordering came out 2% low on an H200 while the serial CPU result was right).
"""

from __future__ import annotations

from functools import reduce

import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi

_COMBINER, _IDENTITY = "tvm_ext.welford_combine", "tvm_ext.welford_identity"


def combine(a, b):
    """Merge two (M2, mean, count) states; an empty side leaves the other unchanged."""
    n = a[2] + b[2]
    delta = b[1] - a[1]
    safe_n = tirx.if_then_else(n == tirx.const(0, n.ty.dtype), tirx.const(1, n.ty.dtype), n)
    return [a[0] + b[0] + delta * delta * a[2] * b[2] / safe_n, a[1] + delta * b[2] / safe_n, n]


def identity(*dtypes):
    return [tirx.const(0, str(d)) for d in dtypes]


def register() -> None:
    """Teach the schedule's reducer matcher the Welford combiner (idempotent).

    The callbacks are global functions so that they outlive the interpreter's shutdown.
    """
    if tvm.get_global_func(_COMBINER, allow_missing=True) is not None:
        return
    tvm_ffi.register_global_func(_COMBINER, lambda x, y: combine(x, y))
    tvm_ffi.register_global_func(_IDENTITY, lambda v: identity(*[e.ty for e in v]))
    tvm.get_global_func("s_tir.schedule.RegisterReducer")(3, tvm.get_global_func(_COMBINER),
                                                          tvm.get_global_func(_IDENTITY))


_welford = te.comm_reducer(lambda a, b: tuple(combine(a, b)), lambda t0, t1, t2: tuple(identity(t0, t1, t2)),
                           name="welford")


def variance_te(x, axes: list[int], keepdims: bool):
    """Population variance of `x` over `axes` in float32, in one Welford reduction."""
    axes = sorted(a % len(x.shape) for a in axes)
    kept = [i for i in range(len(x.shape)) if i not in axes]
    ks = [te.reduce_axis((0, x.shape[a]), name=f"k{a}") for a in axes]

    def at(spatial, reduced):
        index, s, r = [], iter(spatial), iter(reduced)
        for i in range(len(x.shape)):
            index.append(next(r) if i in axes else next(s))
        return x[tuple(index)]

    one, zero = tirx.const(1, "float32"), tirx.const(0, "float32")
    m2, _, _ = te.compute(
        [x.shape[i] for i in kept],
        lambda *i: _welford((zero, at(i, ks).astype("float32"), one), axis=ks),
        name="welford")
    count = reduce(lambda a, b: a * b, [x.shape[a] for a in axes]).astype("float32")
    var = te.compute(m2.shape, lambda *i: (m2(*i) / count).astype(x.dtype), name="variance")
    if keepdims:
        var = topi.reshape(var, [1 if i in axes else x.shape[i] for i in range(len(x.shape))])
    return var


def legalize_variance(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    axes = list(range(len(x.ty.shape.values))) if call.attrs.axis is None else [int(a) for a in call.attrs.axis]
    return bb.call_te(variance_te, x, axes, bool(call.attrs.keepdims), primfunc_name_hint="variance")
