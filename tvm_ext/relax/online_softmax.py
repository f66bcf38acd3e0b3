"""Softmax in one pass over x for its statistics: the row's (sum of exp(x - max), max) as one
reduction, then exp(x - max) / sum.

TVM's softmax takes the max, then the sum of exp(x - max): a row not staged in shared memory is
read three times. The online state reads it twice. Its merge takes one exp: the side with the
smaller max is rescaled by exp(-|m_a - m_b|). The state order (sum, max) is what TVM 0.27's
in-place warp-shuffle all-reduce needs: the sum's update reads both old maxima. The empty state
is (0, lowest finite value), so that a row's -inf elements add exp(-inf) = 0 and no -inf - -inf
is ever taken (a row of -inf alone gives 0 / 0 = NaN, as PyTorch does). See
docs/design.md#online-softmax."""

from __future__ import annotations

from tvm import te, tirx

from tvm_ext.schedules import reducers

from .welford import accumulator

NAME = "online_softmax"


def combine(a, b):
    """Merge two (sum, max) states."""
    rescale = tirx.exp(tirx.const(0, a[1].ty.dtype) - tirx.abs(a[1] - b[1]))
    total = tirx.Select(a[1] >= b[1], a[0] + b[0] * rescale, a[0] * rescale + b[0])
    return [total, tirx.max(a[1], b[1])]


def identity(*dtypes):
    return [tirx.const(0, str(dtypes[0])), tirx.min_value(str(dtypes[1]))]


def register() -> None:
    """Teach the schedule's reducer matcher and the grid templates (schedules.reducers) the merge. Idempotent."""
    reducers.register_with_tvm(NAME, 2, combine, identity)


_online = te.comm_reducer(lambda a, b: tuple(combine(a, b)), lambda t0, t1: tuple(identity(t0, t1)), name=NAME)


def softmax_te(x, axis: int):
    """softmax(x) over `axis`, computed in accumulator(x.dtype) and cast back to x's dtype."""
    axis = axis % len(x.shape)
    acc = accumulator(x.dtype)
    k = te.reduce_axis((0, x.shape[axis]), name="k")
    kept = [d for i, d in enumerate(x.shape) if i != axis]

    def at(i, j):
        return x[tuple(i[:axis]) + (j,) + tuple(i[axis:])].astype(acc)

    total, peak = te.compute(kept, lambda *i: _online((tirx.const(1, acc), at(i, k)), axis=[k]),
                             name="softmax_state", attrs={reducers.ANNOTATION: NAME})

    def out(*i):
        row = i[:axis] + i[axis + 1:]
        return (tirx.exp(x[i].astype(acc) - peak(*row)) / total(*row)).astype(x.dtype)

    return te.compute(x.shape, out, name="T_softmax_norm")
