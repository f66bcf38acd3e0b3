"""Welford variance: one pass over x with a (M2, mean, count) state, stable where E[x^2]-E[x]^2 is not.

TVM legalizes variance in two passes; here it is one reduction whose parallel-Welford combine rule
is registered with TVM's schedule. The state order (M2, mean, count) is required by TVM 0.27's
in-place warp-shuffle all-reduce. See docs/design.md#welford-and-one-pass-variance."""

from __future__ import annotations

from functools import reduce

import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from tvm_ext.schedules import reducers
from tvm_ext.schedules.contracts import PIVOT



def combine(a, b):
    """Merge two (M2, mean, count) states; an empty side leaves the other unchanged.

    Written as M2 = M2_a + M2_b + delta * (mean_b - mean) * n_b (equal to the textbook
    delta^2 n_a n_b / n) so that for a single element b = (0, x, 1), which is what every thread's
    serial loop merges, it simplifies to Welford's streaming update
    mean_k = mean + (x - mean) / k;  M2_k = M2 + (x - mean) * (x - mean_k).
    One reciprocal of the merged count serves both (counts are whole numbers, so max(n, 1) guards
    the empty merge); passes/welford_lower.py makes it the fast approximate reciprocal on CUDA.
    """
    n = a[2] + b[2]
    inv = tirx.const(1, n.ty.dtype) / tirx.max(n, tirx.const(1, n.ty.dtype))
    delta = b[1] - a[1]
    mean = a[1] + delta * b[2] * inv
    return [a[0] + b[0] + delta * (b[1] - mean) * b[2], mean, n]


def identity(*dtypes):
    return [tirx.const(0, str(d)) for d in dtypes]


def _pair_sum(a, b):
    return [a[0] + b[0], a[1] + b[1]]


def register() -> None:
    """Teach the schedule's reducer matcher the Welford and (sum, sum of squares) combiners, and
    the grid templates the Welford merge (schedules.reducers). Idempotent."""
    reducers.register_with_tvm("welford", 3, combine, identity)
    reducers.register_with_tvm("pair_sum", 2, _pair_sum, identity, grid=False)


_welford = te.comm_reducer(lambda a, b: tuple(combine(a, b)), lambda t0, t1, t2: tuple(identity(t0, t1, t2)),
                           name="welford")
_sums = te.comm_reducer(lambda a, b: tuple(_pair_sum(a, b)), lambda t0, t1: tuple(identity(t0, t1)), name="sums")


def accumulator(dtype) -> str:
    """The dtype a reduction over `dtype` data computes in: float64 stays float64 (never rounded
    down), every narrower type is computed in float32, as PyTorch does."""
    return "float64" if str(dtype) == "float64" else "float32"


def _reduction_space(x, axes: list[int]):
    """(kept shape, reduce axes, element(spatial index, reduce index) in accumulator(x.dtype), element count)."""
    ks = [te.reduce_axis((0, x.shape[a]), name=f"k{a}") for a in axes]
    acc = accumulator(x.dtype)

    def element(spatial, reduced=None):
        s, r = iter(spatial), iter(reduced if reduced is not None else ks)
        return x[tuple(next(r) if i in axes else next(s) for i in range(len(x.shape)))].astype(acc)

    kept = [x.shape[i] for i in range(len(x.shape)) if i not in axes]
    return kept, ks, element, reduce(lambda a, b: a * b, [x.shape[a] for a in axes]).astype(acc)


def _welford_state(x, axes: list[int]):
    """(M2, mean, count) of `x` over `axes`, in accumulator(x.dtype), from one Welford reduction.

    The reduction runs on x minus the first element of its row (a pivot: the subtraction is exact
    for the nearby values of data far from zero), so the running mean stays small and keeps its
    digits; the pivot is added back to the mean afterwards.
    """
    kept, ks, element, count = _reduction_space(x, axes)
    one, zero = tirx.const(1, accumulator(x.dtype)), tirx.const(0, accumulator(x.dtype))
    first = [tirx.const(0, k.var.ty.dtype) for k in ks]
    pivot = te.compute(kept, lambda *i: element(i, first), name="pivot", attrs={PIVOT: 1})
    m2, mean, _ = te.compute(kept, lambda *i: _welford((zero, element(i) - pivot(*i), one), axis=ks), name="welford",
                             attrs={reducers.ANNOTATION: "welford"})
    mean = te.compute(kept, lambda *i: mean(*i) + pivot(*i), name="shifted_mean")
    return m2, mean, count


def statistics_te(x, axes: list[int], algorithm: str):
    """(mean, population variance) of `x` over `axes` in accumulator(x.dtype), without the reduced dims, by
    `algorithm`: "welford" (one reduction), "one_pass" (one reduction of sum and sum of squares)
    or "two_pass" (the sum, then the sum of squared deviations: x is read twice)."""
    if algorithm == "welford":
        m2, mean, count = _welford_state(x, axes)
        return mean, te.compute(m2.shape, lambda *i: m2(*i) / count, name="variance")
    kept, ks, element, count = _reduction_space(x, axes)
    if algorithm == "one_pass":
        total, squares = te.compute(kept, lambda *i: _sums((element(i), element(i) * element(i)), axis=ks), name="sums")
        mean = te.compute(kept, lambda *i: total(*i) / count, name="mean")
        return mean, te.compute(kept, lambda *i: squares(*i) / count - mean(*i) * mean(*i), name="variance")
    total = te.compute(kept, lambda *i: te.sum(element(i), axis=ks), name="sum")
    mean = te.compute(kept, lambda *i: total(*i) / count, name="mean")
    ks2 = [te.reduce_axis((0, k.dom.extent), name=f"{k.var.name}_2") for k in ks]
    squared = te.compute(kept, lambda *i: te.sum((element(i, ks2) - mean(*i)) * (element(i, ks2) - mean(*i)), axis=ks2),
                         name="squared_deviations")
    # both results from one block after both sums: the mean between them then inlines into the
    # second, and the kernel stays "reductions, then per-row outputs" (schedules/analysis.py)
    return te.compute(kept, lambda *i: (total(*i) / count, squared(*i) / count), name="statistics")


def keep_dims(t, x, axes):
    """`t` (x without `axes`) reshaped to x's rank, 1 on `axes`."""
    return topi.reshape(t, [1 if i in axes else x.shape[i] for i in range(len(x.shape))])


def variance_te(x, axes: list[int], keepdims: bool, algorithm: str):
    """Population variance of `x` over `axes` by `algorithm` (see statistics_te), in x's dtype.

    Only what the result depends on is in the function (Welford's unused mean is not). "one_pass"
    is kept for comparison: its cancellation loses every digit once the mean is large against
    the spread, and can even go negative.
    """
    var = _cast(statistics_te(x, axes, algorithm)[1], x.dtype)
    return keep_dims(var, x, axes) if keepdims else var


def mean_variance_te(x, axes: list[int], keepdims: bool):
    """(mean, population variance) of `x` over `axes` (sorted, non-negative) from one Welford
    reduction: one read of x."""
    outs = [_cast(t, x.dtype) for t in statistics_te(x, axes, "welford")]
    return [keep_dims(t, x, axes) for t in outs] if keepdims else outs


def _cast(t, dtype):
    return te.compute(t.shape, lambda *i: t(*i).astype(dtype), name=f"{t.op.name}_out")


def axes_of(call: relax.Call) -> list[int]:
    rank = len(call.args[0].ty.shape.values)
    return list(range(rank)) if call.attrs.axis is None else sorted(int(a) % rank for a in call.attrs.axis)


@mutator
class _PairMeanWithVariance(PyExprMutator):
    """mean(x) and variance(x) over the same axes become one Welford call with both outputs."""

    def __init__(self, mod, pairs):
        super().__init__(mod)
        self.pairs, self.fused = pairs, {}

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        key = _statistic_key(call)
        if key is None or key[1:] not in self.pairs:
            return call
        if key[1:] not in self.fused:
            self.fused[key[1:]] = self.builder_.emit(self.builder_.call_te(
                mean_variance_te, call.args[0], axes_of(call), bool(call.attrs.keepdims),
                primfunc_name_hint="mean_variance"))
        return relax.TupleGetItem(self.fused[key[1:]], 0 if key[0] == "relax.mean" else 1)


def bf16_off_gpu(call: relax.Call) -> bool:
    """bfloat16 input on a CPU target: there TVM 0.27's bf16 legalization (bf16 kept as uint16,
    computed in float32) returns garbage for reductions with several outputs (a Welford or
    (sum, sum of squares) state: variance 2.7e8 for data of variance 1), so those use two passes."""
    target = Target.current(allow_none=True)
    return call.args[0].ty.dtype == "bfloat16" and (target is None or target.kind.name != "cuda")


def algorithm_for(call: relax.Call, algorithm: str) -> str:
    """The variance algorithm to legalize `call` with: `algorithm`, or two passes where bf16_off_gpu."""
    return "two_pass" if bf16_off_gpu(call) else algorithm


def _statistic_key(expr):
    """("relax.mean"|"relax.variance", x, axes, keepdims) for those calls on a variable, else None."""
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name in ("relax.mean", "relax.variance") and isinstance(expr.args[0], relax.Var)
            and not bf16_off_gpu(expr)):
        return None
    return expr.op.name, expr.args[0], tuple(axes_of(expr)), bool(expr.attrs.keepdims)


@tvm.transform.module_pass(opt_level=0, name="TVMExtPairMeanWithVariance")
def pair_mean_with_variance(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Batch statistics in one kernel: x is read once for both its mean and its variance."""
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        seen: dict = {}
        tvm_ffi.structural_walk(func.body, (relax.Call, lambda c: _record(seen, c)), order="pre")
        pairs = {rest for rest, ops in seen.items() if ops == {"relax.mean", "relax.variance"}}
        if pairs:
            mutator = _PairMeanWithVariance(mod, pairs)
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
            mod = mutator.builder_.get()
    return mod


def _record(seen: dict, call) -> None:
    key = _statistic_key(call)
    if key is not None:
        seen.setdefault(key[1:], set()).add(key[0])
