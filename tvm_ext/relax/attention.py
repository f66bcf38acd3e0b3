"""Spelled-out softmax attention becomes one fused kernel (schedules/attention.py) on sm_90a, and
one query row (decoding) split-KV kernels (schedules/decode_attention.py) on any CUDA GPU.

matmul(q, k^T) -> scale -> [+ mask] -> softmax -> matmul(., v), as PyTorch eager and TVM's SDPA
import write it, is replaced by a call that reads q, k, v (GQA too) and writes through views.
What is matched, which masks are taken and why the result is exact: docs/attention.md."""

from __future__ import annotations

import functools
import itertools
import logging
import math
from fractions import Fraction

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import GenericConst  # relax constants in 0.27
from tvm.runtime.vm import VirtualMachine
from tvm.target import Target

from tvm_ext.schedules import attention, decode_attention
from tvm_ext.schedules.contracts import COPY_ELEMS, MASK_DTYPES, MASK_FLOOR
from tvm_ext.schedules.device import device_of
from tvm_ext.schedules.strided_view import StridedView

from .. import fallback
from ..tir import check_builds
from ..tir.narrowing import OURS
from .bindings import Bindings, op_name, static_shape
from .legalize import legalizations
from .reduce_fusion import OPAQUE

LOG = logging.getLogger(__name__)
PASSING = ("relax.astype", "relax.reshape", "relax.broadcast_to")  # ops that carry the scores unchanged
VIEWS = ("relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.squeeze", "relax.expand_dims",
         "relax.broadcast_to")  # ops that only move elements: a view of their input
MERGES = ("relax.reshape", "relax.permute_dims")  # views that map one to one, so they can be inverted
SCALINGS = ("relax.multiply", "relax.divide")
FLOATS = ("float16", "bfloat16", "float32")
HALVES = ("float16", "bfloat16")  # operand types of the kernels
MASKED_FILL = -1.0e4  # a finite mask value at or below this counts as masked (see the module docstring)


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _carries(chain: Bindings, var) -> bool:
    """Whether `var` is its input's scores unchanged: a float cast, a reshape that keeps the last
    axis (so each row stays a row, in order), a broadcast_to that changes no shape."""
    call = chain.producer(var)
    if op_name(call) not in PASSING:
        return False
    before, after = static_shape(call.args[0]), static_shape(var)
    if before is None or after is None:
        return False
    if op_name(call) == "relax.astype":
        return _dtype(call.args[0]) in FLOATS and _dtype(var) in FLOATS
    if op_name(call) == "relax.broadcast_to":
        return before == after
    return len(before) > 0 and len(after) > 0 and before[-1] == after[-1]


def _upstream(chain: Bindings, var, uses: int = 1):
    """From `var` (used `uses` times), up through single-use casts, reshapes and broadcasts that
    carry the scores unchanged, to where they were last changed."""
    while chain.uses.get(var, 0) == uses and _carries(chain, var):
        var, uses = chain.producer(var).args[0], 1
    return var


def _scalar(expr) -> float | None:
    if isinstance(expr, GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _constant(chain: Bindings, x) -> float | None:
    """The value of `x` when it is a scalar constant, bound to one, or `full` of one into a 0-d shape
    (transformers 5.24 fills its eager masks' zeros so)."""
    producer = chain.producer(x)
    if isinstance(producer, GenericConst):
        return _scalar(producer)
    if op_name(producer) == "relax.full" and static_shape(producer) == []:
        return _scalar(producer.args[1])
    return _scalar(x)


def _scaling(chain: Bindings, var) -> float | None:
    """The factor when `var` is its input multiplied or divided by a finite nonzero scalar constant."""
    call = chain.producer(var)
    if op_name(call) not in SCALINGS or static_shape(call.args[0]) != static_shape(var) or static_shape(var) is None:
        return None
    c = _scalar(call.args[1])
    if c is None or not math.isfinite(c) or c == 0:
        return None
    return c if op_name(call) == "relax.multiply" else 1.0 / c


def _sdpa_guard(chain: Bindings, probs):
    """(softmax output, softmax input) when `probs` is what TVM's import of
    scaled_dot_product_attention puts after its softmax, exactly:
        where(logical_not(not_equal(max(astype(logical_not(equal(x, -inf)), u8), -1, keepdims), 0)),
              full_like(softmax(x), 0), softmax(x))
    i.e. 0 for rows whose scores are all -inf, the softmax elsewhere; else None."""
    where = chain.producer(probs)
    if op_name(where) != "relax.where" or not chain.only_use(probs):
        return None
    cond, zeros, out = where.args
    softmax = chain.producer(out)
    if op_name(softmax) != "relax.nn.softmax":
        return None
    fill = chain.producer(zeros)
    if op_name(fill) == "relax.full_like" and fill.args[0].same_as(out) and _scalar(fill.args[1]) == 0.0 \
            and chain.only_use(zeros) and static_shape(zeros) == static_shape(out):
        out_uses = 2  # the where and the full_like
    elif _scalar(zeros) == 0.0:
        out_uses = 1
    else:
        return None
    if chain.uses.get(out, 0) != out_uses:
        return None
    x, rank = softmax.args[0], len(static_shape(out) or [])
    steps = (("relax.logical_not", None), ("relax.not_equal", 0.0), ("relax.max", None), ("relax.astype", None),
             ("relax.logical_not", None), ("relax.equal", -math.inf))
    var = cond
    for op, operand in steps:
        call = chain.producer(var)
        if op_name(call) != op or not chain.only_use(var):
            return None
        if operand is not None and _scalar(call.args[1]) != operand:
            return None
        if op == "relax.max" and (call.attrs.axis is None or [int(a) % rank for a in call.attrs.axis] != [rank - 1]
                                  or not call.attrs.keepdims):
            return None
        if op == "relax.astype" and not _dtype(var).startswith(("uint", "int")):
            return None
        var = call.args[0]
    return (out, x) if var.same_as(x) else None


class _Masks:
    """Masks of one function evaluated at compile time; one evaluation per distinct computation."""

    def __init__(self, chain: Bindings):
        self.chain, self.done = chain, []  # [(function, values or None)]

    def values(self, mask) -> np.ndarray | None:
        """`mask` as a float32 array when it is computed from constants only, else None."""
        func = self._function(mask)
        if func is None:
            return None
        for seen, values in self.done:
            if tvm_ffi.structural_equal(seen, func, map_free_vars=True):
                return values
        values = self._evaluate(func)
        self.done.append((func, values))
        return values

    def _function(self, mask) -> relax.Function | None:
        """A function of no parameters computing `mask` from the bindings it needs, or None where
        one of them is a parameter (the mask depends on the data)."""
        chain, bindings, todo, seen = self.chain, [], [mask], set()
        while todo:
            var = todo.pop()
            if not isinstance(var, relax.Var) or var in seen:
                continue
            value = chain.producer(var)
            if value is None:  # a function parameter: not a constant mask
                return None
            seen.add(var)
            bindings.append(relax.VarBinding(var, value))
            todo += list(relax.analysis.free_vars(value))
        order = {var: i for i, var in enumerate(chain.value)}
        bindings.sort(key=lambda b: order[b.var])
        out = relax.Var("mask", mask.ty)  # what leaves the dataflow block must be a plain Var
        return relax.Function([], relax.SeqExpr([relax.DataflowBlock(bindings + [relax.VarBinding(out, mask)])], out),
                              mask.ty)

    @staticmethod
    def _evaluate(func) -> np.ndarray | None:
        mod = relax.transform.LegalizeOps(customize_legalize_map=legalizations())(tvm.IRModule({"main": func}))
        try:  # FoldConstant leaves `full` (no inputs) alone, so run it: a handful of tiny CPU kernels, built
            with tvm.transform.PassContext():  # without the caller's options (CUDA graphs have no CPU runtime)
                return VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"]().numpy().astype("float32")
        except Exception as err:  # noqa: BLE001 (a mask that cannot be evaluated only leaves the chain as it is)
            LOG.debug("attention mask not evaluated (%s): left as it is", err)
            return None


def _mask_kind(masks: _Masks, mask, scores_shape, batch: int, rows: int, cols: int) -> str | None:
    """"none" for an all-zero constant mask, "causal" for the causal one (see the module docstring),
    else None. `scores_shape`: the sum's shape, whose rows are the [batch, rows, cols] scores'."""
    values = masks.values(mask)
    if values is None:
        return None
    try:
        values = np.broadcast_to(values, scores_shape).reshape(batch, rows, cols)
    except ValueError:
        return None
    zero = values == 0
    if zero.all():
        return "none"
    if rows != cols:
        return None
    upper = np.triu(np.ones((rows, cols), bool), 1)
    masked = np.isneginf(values) | (values <= MASKED_FILL)
    return "causal" if bool(zero[:, ~upper].all() and masked[:, upper].all()) else None


def _addable(value: float) -> bool:
    """Whether the kernel adds mask value `value` exactly as the chain does (see schedules/attention.py)."""
    return value == -math.inf or (math.isfinite(value) and abs(value) <= -MASK_FLOOR)


def _float_where(chain: Bindings, mask) -> relax.Call | None:
    """The float `where(cond, a, b)` that `mask` is, under casts between float types, or None."""
    var = mask
    while op_name(chain.producer(var)) == "relax.astype" and _dtype(chain.producer(var).args[0]) in FLOATS:
        var = chain.producer(var).args[0]
    where = chain.producer(var)
    return where if op_name(where) == "relax.where" and _dtype(var) in FLOATS else None


def _passes_through_float16(chain: Bindings, mask) -> bool:
    """Whether `mask` is a float16 tensor, maybe cast to other float types: every finite value then
    lies within +-65504 (T5's learned position bias plus its padding mask)."""
    var = mask
    while _dtype(var) != "float16" and op_name(chain.producer(var)) == "relax.astype" \
            and _dtype(chain.producer(var).args[0]) in FLOATS:
        var = chain.producer(var).args[0]
    return _dtype(var) == "float16"


def _mask_values_addable(chain: Bindings, masks: _Masks, mask) -> bool:
    """Whether every value `mask` can take is one the kernel adds exactly: a constant mask is
    evaluated; otherwise it must have passed through float16 (whose finite values all lie within
    the kernel's bounds), or be where(cond, a, b) (the data picks) of scalar constants a and b,
    maybe cast to another float type."""
    values = masks.values(mask)
    if values is not None:
        return bool(np.all(np.isneginf(values) | (np.isfinite(values) & (np.abs(values) <= -MASK_FLOOR))))
    if _passes_through_float16(chain, mask):
        return True
    where = _float_where(chain, mask)
    if where is None:
        return False
    branches = [_constant(chain, x) for x in where.args[1:]]
    return all(x is not None and _addable(x) for x in branches)


def _mask_operand(chain: Bindings, masks: _Masks, mask, mask_sum, logical: list[int]) -> tuple | None:
    """(tensor, view of the [batch, seq_q, seq_kv] mask in it, dtype) for the kernel to add the
    mask itself (one that depends on the data: padding), or None. The view repeats a mask
    broadcast over heads (or queries) with stride 0; casts float16 -> float32 and layout ops before
    the mask are looked through."""
    if static_shape(mask) is None or not _mask_values_addable(chain, masks, mask):
        return None
    for source, view, _ in reversed(_views_of(chain, mask, scaled=False, dtypes=MASK_DTYPES)):
        view = view.broadcast(mask_sum)
        view = view and view.reshape(logical)
        if view is not None:
            return source, view, _dtype(source)
    return None


def _causal_within(chain: Bindings, masks: _Masks, mask, mask_sum, logical: list[int]) -> bool:
    """Whether a mask the kernel adds is also causal: [astype](where(cond, a, -inf)) with cond =
    [broadcast_to](bitwise_and(x, y)) where x or y is a constant that is the causal pattern (True
    on and below the diagonal, False above): above the diagonal the mask is -inf whatever the data,
    so the kernel may skip those key tiles (LLaMA's causal-and-padding mask with SDPA). Not with a
    finite fill (eager's finfo.min): a row whose every key is masked then takes the softmax over
    all keys, the ones above the diagonal too."""
    rows, cols = logical[1:]
    where = _float_where(chain, mask)
    if where is None or rows != cols:
        return False
    if _constant(chain, where.args[2]) != -math.inf:
        return False
    cond = where.args[0]
    while op_name(chain.producer(cond)) == "relax.broadcast_to":
        cond = chain.producer(cond).args[0]
    both = chain.producer(cond)
    if op_name(both) not in ("relax.bitwise_and", "relax.logical_and") or _dtype(cond) != "bool":
        return False
    lower = np.tril(np.ones((rows, cols), bool))
    for side in both.args:
        values = masks.values(side) if isinstance(side, relax.Var) else None
        if values is None:
            continue
        try:
            values = np.broadcast_to(values, mask_sum).reshape(logical)
        except ValueError:
            continue
        if bool(np.all(values == lower)):
            return True
    return False


def _match(chain: Bindings, final, masks: _Masks) -> dict | None:
    """The attention chain ending in the astype-to-fp16 or bf16 `final`, or None."""
    value = chain.value[final]
    if op_name(value) != "relax.astype" or _dtype(value) not in HALVES:
        return None
    dtype = _dtype(value)
    out3 = value.args[0]  # the P V product, maybe reshaped
    while op_name(chain.producer(out3)) == "relax.reshape" and chain.only_use(out3):
        out3 = chain.producer(out3).args[0]
    pv = chain.producer(out3)
    if op_name(pv) != "relax.matmul" or not chain.only_use(out3):
        return None
    p3, v3 = pv.args
    probs = _upstream(chain, p3)
    guard = _sdpa_guard(chain, probs)
    softmax_out = guard[0] if guard else probs
    softmax = chain.producer(softmax_out)
    if op_name(softmax) != "relax.nn.softmax" or (guard is None and not chain.only_use(softmax_out)) \
            or int(softmax.attrs.axis) not in (-1, len(static_shape(softmax_out) or []) - 1):
        return None
    x = softmax.args[0]
    x_uses = 2 if guard else 1  # the guard's equal(x, -inf) reads the softmax's input too
    scores = _upstream(chain, x, x_uses)
    uses = x_uses if scores.same_as(x) else 1
    mask = None
    if op_name(chain.producer(scores)) == "relax.add" and chain.uses.get(scores, 0) == uses:
        a, b = chain.producer(scores).args
        for lhs, other in ((a, b), (b, a)):  # the scores' side leads to the matmul, maybe scaled
            up = _upstream(chain, lhs)
            if static_shape(lhs) == static_shape(scores) and \
                    (_scaling(chain, up) is not None or op_name(chain.producer(up)) == "relax.matmul"):
                mask, mask_sum, scores, uses = other, static_shape(scores), up, 1
                break
        else:
            return None
    scale = 1.0
    if (factor := _scaling(chain, scores)) is not None and chain.uses.get(scores, 0) == uses:
        scale = factor
        scores, uses = _upstream(chain, chain.producer(scores).args[0]), 1
    qk = chain.producer(scores)
    if op_name(qk) != "relax.matmul" or chain.uses.get(scores, 0) != uses:
        return None
    q3, kt3 = qk.args
    shapes = [static_shape(x) for x in (q3, kt3, v3, p3, out3, final)]
    if any(s is None for s in shapes) or any(len(s) != 3 for s in shapes[:5]) \
            or any(_dtype(x) not in FLOATS for x in (q3, kt3, v3)):
        return None
    (batch, seq_q, dim), (_, _, seq_kv) = shapes[0], shapes[1]
    if shapes[1] != [batch, dim, seq_kv] or shapes[2] != [batch, seq_kv, dim] or shapes[3] != [batch, seq_q, seq_kv] \
            or shapes[4] != [batch, seq_q, dim] or math.prod(shapes[5]) != batch * seq_q * dim:
        return None
    causal, added = False, None
    if mask is not None:
        kind = _mask_kind(masks, mask, mask_sum, batch, seq_q, seq_kv)
        if kind is None:  # not a constant causal or zero mask: the kernel adds it, where it can
            added = _mask_operand(chain, masks, mask, mask_sum, [batch, seq_q, seq_kv])
            if added is None:
                LOG.debug("attention with a mask the kernel cannot add: left as it is")
                return None
        causal = kind == "causal" or (added is not None and _causal_within(chain, masks, mask, mask_sum,
                                                                             [batch, seq_q, seq_kv]))
    q, k, v = (_readable(_views_of(chain, q3, scaled=True, dtypes=(dtype,))),
               _readable(_views_of(chain, kt3, scaled=True, dtypes=(dtype,)), transpose=True),
               _readable(_views_of(chain, v3, scaled=False, dtypes=(dtype,))))
    if q is None or v is None:  # rows the 16-byte copies cannot read, or no tensor of the output's dtype to read
        return None
    if k is None:  # k^T computed, not a view of k: transpose it into a contiguous K
        if _dtype(kt3) != dtype:
            return None
        k = (relax.op.permute_dims(kt3, [0, 2, 1]), StridedView.contiguous([batch, seq_kv, dim]), 1.0)
    out = _destination(chain, final, [batch, seq_q, dim])
    sources = {"q": q[:2], "k": k[:2], "v": v[:2], "out": out}
    grown = {}
    for name in ("k", "v") if seq_q == 1 and added is None else ():
        if (parts := _concatenated(chain, sources[name], seq_kv)) is not None:
            grown[name] = parts[2]
            sources.update({f"{name}_past": (parts[0], None), f"{name}_new": (parts[1], None)})
    scale *= q[2] * k[2]
    given = {name: (view.shape if isinstance(x, relax.Call) else tuple(static_shape(x)),
                    view or StridedView.contiguous(static_shape(x))) for name, (x, view) in sources.items()}
    mask_given = None if added is None else (tuple(static_shape(added[0])), added[1], added[2])
    decoding = seq_q == 1 and added is None  # one query row: split over the keys instead
    if not (decode_attention.fits(batch, seq_kv, dim, given) if decoding else
            attention.fits(batch, seq_q, seq_kv, dim, causal, given=given, mask=mask_given)):
        return None
    return {"sources": sources, "given": given, "sizes": (batch, seq_q, seq_kv, dim), "scale": scale, "causal": causal,
            "mask": None if added is None else (added[0], mask_given), "empty_rows_zero": added is not None and guard is not None,
            "decoding": decoding, "dtype": dtype, "grown": grown}


def _concatenated(chain: Bindings, source: tuple, seq_kv: int) -> tuple | None:
    """(past, new, axis) where decoding's K or V (tensor, view of [rows, keys, dim] in it) is the whole of
    `concat((past, new), axis)` with the keys along `axis` (a KV cache grown by this step's rows): the
    kernel then reads both and writes the concatenation, so that no copy kernel reads the cache first."""
    x, view = source
    call = chain.producer(x)
    if op_name(call) != "relax.concat":
        return None
    parts = call.args[0] if isinstance(call.args[0], relax.Tuple) else chain.producer(call.args[0])
    if not isinstance(parts, relax.Tuple) or len(parts.fields) != 2:
        return None
    shape, (past, new) = static_shape(x), parts.fields
    axis = int(call.attrs.axis) % len(shape)
    if any(static_shape(p) is None or _dtype(p) != _dtype(x) for p in (past, new)) \
            or shape[axis] != seq_kv or view.axes[1] != ((seq_kv, math.prod(shape[axis + 1:])),) or not view.covers(shape):
        return None
    return past, new, axis


def _permutation(call: relax.Call, rank: int) -> list[int]:
    """The axes of a permute_dims call (none given: all reversed)."""
    return list(range(rank - 1, -1, -1)) if call.attrs.axes is None else [int(a) for a in call.attrs.axes]


def _view_after(call: relax.Call, out_shape: list[int], view: StridedView) -> StridedView | None:
    """`view` (of the call's input) after the layout op `call`, whose result has `out_shape`."""
    op, rank = op_name(call), len(view.axes)
    if op == "relax.reshape":
        return view.reshape(out_shape)
    if op == "relax.broadcast_to":
        return view.broadcast(out_shape)
    if op == "relax.permute_dims":
        return view.permute(_permutation(call, rank))
    if op == "relax.squeeze":
        axes = [i for i, n in enumerate(view.shape) if n == 1] if call.attrs.axis is None else call.attrs.axis
        return view.squeeze([int(a) % rank for a in axes])
    if op == "relax.expand_dims":
        return view.expand_dims([int(a) % len(out_shape) for a in call.attrs.axis])
    axes, begins = ([int(x) for x in arg.fields] for arg in call.args[1:3])  # strided_slice
    steps = [int(x) for x in call.args[4].fields] if len(call.args) > 4 else [1] * len(axes)
    for axis, begin, step in zip(axes, begins, steps):
        axis %= rank
        view = view and view.slice(axis, begin + view.shape[axis] if begin < 0 else begin, step, out_shape[axis])
    return view


def _step_up(chain: Bindings, var, scaled: bool) -> tuple | None:
    """(input, factor) where `var` is its input moved (a view), cast fp16 or bf16 -> float32 (exactly),
    or, when `scaled`, multiplied by `factor`; else None."""
    call = chain.producer(var)
    op = op_name(call)
    if op in VIEWS and static_shape(call.args[0]) is not None:
        return call.args[0], 1.0
    if op == "relax.astype" and _dtype(var) == "float32" and _dtype(call.args[0]) in HALVES:
        return call.args[0], 1.0
    if scaled and (factor := _scaling(chain, var)) is not None:
        return call.args[0], factor
    return None


def _views_of(chain: Bindings, var, scaled: bool, dtypes=("float16",)) -> list[tuple]:
    """(tensor of `dtypes`, view of `var` in it, factor) for `var` itself and each such tensor it was
    reshaped, transposed, sliced, broadcast, cast or (`scaled`) multiplied by a scalar from, nearest
    first: `var` = factor x the view's elements. Those no view can describe are left out."""
    path, factors = [var], [1.0]
    while (step := _step_up(chain, path[-1], scaled)) is not None:
        path.append(step[0])
        factors.append(factors[-1] * step[1])
    found = []
    for i, source in enumerate(path):
        if _dtype(source) not in dtypes:
            continue
        view = StridedView.contiguous(static_shape(source))
        for x in reversed(path[:i]):
            if op_name(chain.producer(x)) in VIEWS:
                view = view and _view_after(chain.producer(x), static_shape(x), view)
        if view is not None:
            found.append((source, view, factors[i]))
    return found


def _readable(views: list[tuple], transpose: bool = False) -> tuple | None:
    """The furthest-back (tensor, view, factor) that the kernel's 16-byte row copies can read (the
    view transposed in its last two axes first: k from k^T), or None."""
    views = [(x, view.permute([0, 2, 1]) if transpose else view, f) for x, view, f in views]
    usable = [found for found in views if found[1].unit_stride_rows(-1, COPY_ELEMS)]
    return usable[-1] if usable else None


def _destination(chain: Bindings, final, logical: list[int]) -> tuple:
    """(tensor, view of the [batch, seq, dim] output in it): the furthest tensor that `final` is
    only reshaped and transposed into (the heads merged back into rows), where the kernel can
    write directly; `final` itself where no view describes that."""
    path = [final]
    while op_name(chain.value.get(chain.sole_user(path[-1]))) in MERGES and static_shape(chain.sole_user(path[-1])) is not None:
        path.append(chain.sole_user(path[-1]))
    view = StridedView.contiguous(static_shape(path[-1]))
    for x, before in zip(reversed(path[1:]), reversed(path[:-1])):  # undo each op, last first
        call = chain.value[x]
        if op_name(call) == "relax.reshape":
            view = view.reshape(static_shape(before))
        else:
            view = view.permute(np.argsort(_permutation(call, len(view.axes))))
        if view is None:
            break
    view = view and view.reshape(logical)
    if view is None:
        return final, StridedView.contiguous(static_shape(final)).reshape(logical)
    return path[-1], view


KERNEL_ATTRS = {"op_pattern": OPAQUE, "tirx.is_scheduled": True}


def _prefill_kernel(found: dict) -> tirx.PrimFunc:
    batch, seq_q, seq_kv, dim = found["sizes"]
    mask = found["mask"]
    masked = {} if mask is None else {"mask": mask[1], "empty_rows_zero": found["empty_rows_zero"]}
    return attention.kernel(batch, seq_q, seq_kv, dim, found["scale"], found["causal"], given=found["given"],
                            dtype=found["dtype"], **masked)


def _decode_kernels(found: dict) -> tuple:
    """(partial kernel, its scalar dims, combine kernel, its scalar dims) of split-KV decoding attention."""
    batch, _, seq_kv, dim = found["sizes"]
    sm_count = device_of(Target.current()).sm_count
    partial, dims = decode_attention.with_scalar_dims(decode_attention.partial_kernel(
        batch, seq_kv, dim, found["scale"], sm_count, given=found["given"], dtype=found["dtype"], grown=found["grown"]),
        outputs=2 + len(found["grown"]))
    combine, combine_dims = decode_attention.with_scalar_dims(
        decode_attention.combine_kernel(batch, seq_kv, dim, sm_count, out=found["given"]["out"], dtype=found["dtype"]))
    return partial, dims, combine, combine_dims


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, matches: dict):
        super().__init__(mod)
        self.matches = matches

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.matches.get(binding.var)
        kernels = None
        if found is not None:
            name = "fused_decode_attention" if found["decoding"] else "fused_attention"
            try:
                kernels = _decode_kernels(found) if found["decoding"] else (_prefill_kernel(found),)
                for func in kernels[::2]:  # the PrimFuncs (a decode kernel is followed by its scalar dims)
                    check_builds(func, name, Target.current())
            except Exception as err:  # noqa: BLE001 (a kernel of ours that does not build costs speed, never the build)
                fallback.warn_build_failed(name, err, "tvm_ext attention kernel")
                kernels = None
        if kernels is None:
            super().visit_var_binding_(binding)
        elif found["decoding"]:
            self._decode(binding, found, *kernels)
        else:
            self._prefill(binding, found, kernels[0])

    def _add(self, func: tirx.PrimFunc, name: str, narrowed: bool = False) -> relax.GlobalVar:
        """`func` in the module, named after its GlobalVar (two attention shapes, two names); `narrowed`:
        given int32 indices where its sizes allow (tir/narrowing.py; the wgmma kernel's do not narrow)."""
        attrs = {**KERNEL_ATTRS, OURS: True} if narrowed else KERNEL_ATTRS
        return self.builder_.add_func(func.without_attr("global_symbol").with_attrs(attrs), name)

    def _inputs(self, found: dict) -> list:
        """q, k, v as the kernel reads them: a grown cache as its past and new parts."""
        names = [part for name in ("q", "k", "v")
                 for part in ((f"{name}_past", f"{name}_new") if name in found["grown"] else (name,))]
        inputs = [self.visit_expr(found["sources"][name][0]) for name in names]
        return [self.builder_.emit(x) if isinstance(x, relax.Call) else x for x in inputs]  # K transposed

    def _prefill(self, binding: relax.VarBinding, found: dict, kernel: tirx.PrimFunc) -> None:
        seq_q, mask = found["sizes"][1], found["mask"]
        inputs = self._inputs(found) + ([] if mask is None else [self.visit_expr(mask[0])])
        inputs += [seq_q] if isinstance(seq_q, tvm.tirx.Var) else []  # the kernel's scalar parameter
        call = relax.call_tir(self._add(kernel, "fused_attention"), inputs,
                              relax.TensorType(found["given"]["out"][0], found["dtype"]))
        self.set_var_remap(binding.var, self.builder_.emit(call, binding.var.name))

    def _decode(self, binding: relax.VarBinding, found: dict, partial, dims, combine, combine_dims) -> None:
        """Split-KV decoding attention: the chunks' softmax states into a workspace, then combined.
        A grown cache is the partial kernel's output from here on (the concatenation left unused)."""
        batch, dim = found["sizes"][0], found["sizes"][3]
        grown = [name for name in ("k", "v") if name in found["grown"]]
        states = self.builder_.emit(relax.call_tir(
            self._add(partial, "fused_decode_attention", narrowed=True), [*self._inputs(found), *dims],
            [relax.TensorType(shape, "float32") for shape in decode_attention.workspace_shapes(batch, dim)]
            + [relax.TensorType(found["given"][name][0], found["dtype"]) for name in grown]))
        for i, name in enumerate(grown):
            self.set_var_remap(found["sources"][name][0], self.builder_.emit(relax.TupleGetItem(states, 2 + i)))
        call = relax.call_tir(self._add(combine, "fused_decode_attention_combine", narrowed=True),
                              [self.builder_.emit(relax.TupleGetItem(states, i)) for i in range(2)] + combine_dims,
                              relax.TensorType(found["given"]["out"][0], found["dtype"]))
        self.set_var_remap(binding.var, self.builder_.emit(call, binding.var.name))


# Stand-ins for a symbolic dim: the chain is matched at each (at every combination, for two dims), and
# what it reads and writes fitted as polynomials in the dims (of degree 2 at most in each: three
# values fit, the fourth checks). Their residues differ (mod 8 and mod 64): a view whose rows are
# not 16-byte aligned at every length fails at one of them, and no length is a whole number of tiles.
SAMPLE_LENGTHS = (67, 130, 201, 268)
MAX_SYMBOLIC_DIMS = 2  # 4 ** dims matches: a sequence length, or a batch and a cache length


def _matches(func: relax.Function) -> dict:
    """{output var: match} of func's attention chains (see `_match`), over static shapes or over
    its symbolic dims (`_matches_at_any_size`)."""
    dims = {str(d): d for p in func.params if isinstance(p.ty, relax.TensorType) and isinstance(p.ty.shape, relax.ShapeExpr)
            for d in p.ty.shape.values if isinstance(d, tvm.tirx.Var)}
    if dims:
        return _matches_at_any_size(func, [dims[name] for name in sorted(dims)]) if len(dims) <= MAX_SYMBOLIC_DIMS else {}
    chain = Bindings(func)
    masks = _Masks(chain)
    return {found["sources"]["out"][0]: found for var in chain.value if (found := _match(chain, var, masks)) is not None}


def _matches_at_any_size(func: relax.Function, dims: list) -> dict:
    """The attention chains of `func` whose match at every combination of sample values of `dims`
    (SAMPLE_LENGTHS) is the same chain with the same kernel but for sizes and views that are
    polynomials in the dims: each with its sizes and views as expressions of them and its operands
    as `func`'s variables. A chain with a mask the kernel adds (one that depends on the data) is left
    as it is."""
    samples = []
    for point in itertools.product(SAMPLE_LENGTHS, repeat=len(dims)):
        bound = func.bind_symbolic_vars(dict(zip(dims, point)))
        chain = Bindings(bound)
        masks = _Masks(chain)
        names = dict(zip([*bound.params, *chain.value], [*func.params, *Bindings(func).value]))  # sample's -> func's
        samples.append((names, {names[v]: found for v in chain.value if (found := _match(chain, v, masks)) is not None}))
    found = {}
    for var in set.intersection(*(set(matches) for _, matches in samples)):
        runs = [(names, matches[var]) for names, matches in samples]
        general = _generalised(runs, dims)
        if general is not None:
            found[general["sources"]["out"][0]] = general
    return found


def _generalised(runs: list, dims: list) -> dict | None:
    """One match over `dims` from the matches at their sample values (with each sample's var ->
    func's var), or None where they differ in anything but polynomial sizes and views, or where the
    query and key lengths are neither one symbolic length (prefill) nor one query row (decoding)."""
    first = runs[0][1]
    if any(m["mask"] is not None or m["causal"] != first["causal"] or m["scale"] != first["scale"]
           or m["grown"] != first["grown"] for _, m in runs):
        return None
    sources = {}
    for name in first["sources"]:
        vars_ = {names.get(m["sources"][name][0]) for names, m in runs if isinstance(m["sources"][name][0], relax.Var)}
        if len(vars_) != 1 or None in vars_ or len(runs) != sum(isinstance(m["sources"][name][0], relax.Var) for _, m in runs):
            return None  # computed operands (K transposed by a kernel) or different tensors
        sources[name] = (vars_.pop(), None)
    sizes = _fitted([m["sizes"] for _, m in runs], dims)
    given = {name: _fitted([(tuple(m["given"][name][0]), _flat(m["given"][name][1])) for _, m in runs], dims)
             for name in first["given"]}
    if sizes is None or any(g is None for g in given.values()):
        return None
    seq_q, seq_kv = sizes[1:3]
    if not (seq_q == 1 if isinstance(seq_q, int) else isinstance(seq_q, tvm.tirx.Var) and seq_q.same_as(seq_kv)):
        return None
    given = {name: (shape, StridedView(*view)) for name, (shape, view) in given.items()}
    return {**first, "sources": sources, "given": given, "sizes": tuple(sizes)}


def _flat(view: StridedView) -> tuple:
    return view.axes, view.offset


def _fitted(samples: list, dims: list):
    """`samples` (the same nested structure of ints at each combination of sample values of `dims`,
    in `itertools.product` order) as one structure of ints and expressions of the dims, each a
    polynomial with integer coefficients of degree <= 2 in each dim, through the first three
    values of a dim that the fourth agrees with; None where none is."""
    first = samples[0]
    if isinstance(first, (tuple, list)):
        if any(not isinstance(x, (tuple, list)) or len(x) != len(first) for x in samples):
            return None
        parts = [_fitted([x[i] for x in samples], dims) for i in range(len(first))]
        return None if any(p is None for p in parts) else type(first)(parts)
    points = dict(zip(itertools.product(SAMPLE_LENGTHS, repeat=len(dims)), (int(x) for x in samples)))
    terms = _polynomial(points)
    if terms is None:
        return None
    if all(sum(powers) == 0 for powers in terms):
        return terms.get((0,) * len(dims), 0)
    powers = next(iter(terms))
    if len(terms) == 1 and terms[powers] == 1 and sorted(powers) == [0] * (len(dims) - 1) + [1]:
        return dims[powers.index(1)]  # a dim itself, kept as it is
    expr = None
    for powers, coeff in sorted(terms.items()):
        term = functools.reduce(lambda a, b: a * b, [d for d, n in zip(dims, powers) for _ in range(n)],
                                tvm.tirx.const(coeff, str(dims[0].ty)))
        expr = term if expr is None else expr + term
    return tvm.sym.Analyzer().simplify(expr)


def _polynomial(points: dict) -> dict | None:
    """{powers of each dim: integer coefficient} of the polynomial through `points` ({sample values
    of each dim: value}), fitted dim by dim (the first dim's coefficients are polynomials in the
    rest); None where a coefficient is not an integer or a fourth value disagrees."""
    if next(iter(points)) == ():
        return {(): points[()]}
    per_value = [_polynomial({p[1:]: y for p, y in points.items() if p[0] == x}) for x in SAMPLE_LENGTHS]
    if any(p is None for p in per_value):
        return None
    terms = {}
    for rest in set().union(*per_value):
        coeffs = _quadratic([p.get(rest, 0) for p in per_value])
        if coeffs is None:
            return None
        terms.update({(power, *rest): c for power, c in enumerate(coeffs) if c})
    return terms


def _quadratic(values: list) -> tuple | None:
    """(c, b, a) integers with a x^2 + b x + c through the values at SAMPLE_LENGTHS, or None."""
    (x0, x1, x2, x3), (y0, y1, y2, y3) = SAMPLE_LENGTHS, values
    # Newton's divided differences over the first three, in exact fractions
    d01, d12 = Fraction(y1 - y0, x1 - x0), Fraction(y2 - y1, x2 - x1)
    a = (d12 - d01) / (x2 - x0)
    b = d01 - a * (x0 + x1)
    c = y0 - a * x0 * x0 - b * x0
    if any(q.denominator != 1 for q in (a, b, c)) or a * x3 * x3 + b * x3 + c != y3:
        return None
    return int(c), int(b), int(a)


@tvm.transform.module_pass(opt_level=0, name="TVMExtFuseAttention")
def fuse_attention(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Replace each spelled-out attention with fused kernels on CUDA: one query row (decoding) on
    any architecture, longer queries where the target has wgmma."""
    target = Target.current()
    if target is None or target.kind.name != "cuda":
        return mod
    wgmma = device_of(target).wgmma
    rewritten = mod
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        matches = {var: m for var, m in _matches(func).items() if m["decoding"] or wgmma}
        if not matches:
            continue
        rewriter = _Rewriter(rewritten, matches)
        rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(rewriter.visit_expr(func)))
        rewritten = rewriter.builder_.get()
        LOG.debug("%s: %d attention chain(s) fused", gv.name_hint, len(matches))
    return rewritten
