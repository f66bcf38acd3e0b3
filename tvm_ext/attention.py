"""Spelled-out softmax attention becomes one fused kernel (schedules/attention.py) on sm_90a.

PyTorch models (Hugging Face's eager attention, ours in examples/torch_models.py) write attention as
matmul(q, k^T) -> scale -> [+ mask] -> softmax in float32 -> matmul(., v); imported, that is three
kernels around a score matrix of batch x heads x seq x seq, and FuseOps cannot join them. This pass
finds the chain in Relax, before legalization, and replaces it with a call of the fused kernel:

    mm = matmul(q3, kt3, f32) -> astype f16 | reshape ... -> divide/multiply by a scalar constant
    -> [add a mask] -> astype f32 -> softmax(-1) -> astype f16 | reshape | broadcast_to ...
    -> matmul(p3, v3, f32) -> astype f16 (the value replaced)

Every value inside the chain must have no other use. A mask is accepted when it is built from
constants only and evaluates (at compile time) to the causal mask: 0 on and below the diagonal,
-inf above; any other mask leaves the chain as it is. The kernel computes the scores in float32 and
never rounds them to fp16, so it is at least as accurate as the chain it replaces.

The kernel reads q, k and v where their producers wrote them and writes where the consumer reads:
the reshapes, transposes, slices and broadcasts between (BERT's packed qkv split into heads, k^T,
the heads merged back into rows) become views (schedules/strided_view.py) instead of copy kernels.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import GenericConst  # relax constants in 0.27
from tvm.runtime.vm import VirtualMachine
from tvm.target import Target

from schedules import attention
from schedules.device import device_of
from schedules.strided_view import StridedView

from .bindings import Bindings, op_name
from .layout_rewrites import static_shape
from .legalize import legalizations

LOG = logging.getLogger(__name__)
PASSING = ("relax.astype", "relax.reshape", "relax.broadcast_to")  # ops that carry the scores unchanged
VIEWS = ("relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.squeeze", "relax.expand_dims",
         "relax.broadcast_to")  # ops that only move elements: a view of their input
MERGES = ("relax.reshape", "relax.permute_dims")  # views that map one to one, so they can be inverted
OPAQUE = 8  # relax's OpPatternKind kOpaque: FuseOps never fuses it with its neighbours


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _upstream(chain: Bindings, var):
    """From `var`, up through single-use astype/reshape/broadcast_to bindings to where the scores
    were last changed."""
    while op_name(chain.producer(var)) in PASSING and chain.only_use(var):
        var = chain.producer(var).args[0]
    return var


def _scalar(expr) -> float | None:
    if isinstance(expr, GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _is_causal(chain: Bindings, mask, rows: int, cols: int) -> bool:
    """Whether `mask`, computed from constants only, is 0 at and below the diagonal, -inf above."""
    bindings, todo, seen = [], [mask], set()
    while todo:
        var = todo.pop()
        if not isinstance(var, relax.Var) or var in seen:
            continue
        value = chain.producer(var)
        if value is None:  # a function parameter: not a constant mask
            return False
        seen.add(var)
        bindings.append(relax.VarBinding(var, value))
        todo += list(relax.analysis.free_vars(value))
    order = {var: i for i, var in enumerate(chain.value)}
    bindings.sort(key=lambda b: order[b.var])
    out = relax.Var("mask", mask.ty)  # what leaves the dataflow block must be a plain Var
    func = relax.Function([], relax.SeqExpr([relax.DataflowBlock(bindings + [relax.VarBinding(out, mask)])], out), mask.ty)
    mod = relax.transform.LegalizeOps(customize_legalize_map=legalizations())(tvm.IRModule({"main": func}))
    try:  # FoldConstant leaves `full` (no inputs) alone, so run it: a handful of tiny CPU kernels, built
        with tvm.transform.PassContext():  # without the caller's options (CUDA graphs have no CPU runtime)
            values = VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"]().numpy().astype("float32")
    except Exception as err:  # noqa: BLE001 (a mask that cannot be evaluated only leaves the chain as it is)
        LOG.debug("attention mask not evaluated (%s): left as it is", err)
        return False
    if values.ndim > 2 and all(d == 1 for d in values.shape[:-2]):  # a [1, 1, rows, cols] mask
        values = values.reshape(values.shape[-2:])
    if values.ndim > 2:
        return False
    values = np.broadcast_to(values, (rows, cols))
    upper = np.triu(np.ones((rows, cols), bool), 1)
    return bool(np.all(values[~upper] == 0) and np.all(np.isneginf(values[upper])))


def _match(chain: Bindings, final) -> dict | None:
    """The attention chain ending in the astype-to-fp16 `final`, or None."""
    value = chain.value[final]
    if op_name(value) != "relax.astype" or _dtype(value) != "float16":
        return None
    pv = chain.producer(value.args[0])
    if op_name(pv) != "relax.matmul" or not chain.only_use(value.args[0]):
        return None
    p3, v3 = pv.args
    softmax_out = _upstream(chain, p3)
    softmax = chain.producer(softmax_out)
    if op_name(softmax) != "relax.nn.softmax" or not chain.only_use(softmax_out) \
            or int(softmax.attrs.axis) not in (-1, len(static_shape(softmax_out) or []) - 1):
        return None
    scores = _upstream(chain, softmax.args[0])
    mask, causal = None, False
    if op_name(chain.producer(scores)) == "relax.add" and chain.only_use(scores):
        lhs, mask = chain.producer(scores).args
        scores = _upstream(chain, lhs)
    scaling = chain.producer(scores)
    if op_name(scaling) not in ("relax.divide", "relax.multiply") or not chain.only_use(scores) \
            or _scalar(scaling.args[1]) is None:
        return None
    scale = _scalar(scaling.args[1])
    scale = 1.0 / scale if op_name(scaling) == "relax.divide" else scale
    mm_out = _upstream(chain, scaling.args[0])
    qk = chain.producer(mm_out)
    if op_name(qk) != "relax.matmul" or not chain.only_use(mm_out):
        return None
    q3, kt3 = qk.args
    shapes = [static_shape(x) for x in (q3, kt3, v3, final)]
    if any(s is None or len(s) != 3 for s in shapes) or any(_dtype(x) != "float16" for x in (q3, kt3, v3)):
        return None
    (batch, seq_q, dim), (_, _, seq_kv) = shapes[0], shapes[1]
    if shapes[1] != [batch, dim, seq_kv] or shapes[2] != [batch, seq_kv, dim] or shapes[3] != [batch, seq_q, dim]:
        return None
    if mask is not None:
        causal = _is_causal(chain, mask, seq_q, seq_kv)
        if not causal:
            LOG.debug("attention with a mask that is not causal: left as it is")
            return None
    sources = {"q": _readable(_views_of(chain, q3)), "v": _readable(_views_of(chain, v3)),
               "k": _readable([(x, view.permute([0, 2, 1])) for x, view in _views_of(chain, kt3)]),
               "out": _destination(chain, final)}
    if sources["q"] is None or sources["v"] is None:  # rows the 16-byte copies cannot read
        return None
    if sources["k"] is None:  # k^T computed, not a view of k: transpose it into a contiguous K
        sources["k"] = (relax.op.permute_dims(kt3, [0, 2, 1]), StridedView.contiguous([batch, seq_kv, dim]))
    given = {name: (view.shape if isinstance(x, relax.Call) else tuple(static_shape(x)), view)
             for name, (x, view) in sources.items()}
    if not attention.fits(batch, seq_q, seq_kv, dim, causal, given=given):
        return None
    return {"sources": sources, "given": given, "sizes": (batch, seq_q, seq_kv, dim), "scale": scale, "causal": causal}


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


def _views_of(chain: Bindings, var) -> list[tuple]:
    """(tensor, view of `var` in it) for `var` itself and for each tensor it was reshaped,
    transposed, sliced or broadcast from, nearest first; those no view can describe are left out."""
    path = [var]
    while op_name(chain.producer(path[-1])) in VIEWS and static_shape(chain.producer(path[-1]).args[0]) is not None:
        path.append(chain.producer(path[-1]).args[0])
    found = []
    for i, source in enumerate(path):
        view = StridedView.contiguous(static_shape(source))
        for x in reversed(path[:i]):
            view = view and _view_after(chain.producer(x), static_shape(x), view)
        if view is not None:
            found.append((source, view))
    return found


def _readable(views: list[tuple]) -> tuple | None:
    """The furthest-back (tensor, view) that the kernel's 16-byte row copies can read, or None."""
    usable = [(x, view) for x, view in views if view.unit_stride_rows(-1, attention.COPY_ELEMS)]
    return usable[-1] if usable else None


def _destination(chain: Bindings, final) -> tuple:
    """(tensor, view of `final` in it): the furthest tensor that `final` is only reshaped and
    transposed into (the heads merged back into rows), where the kernel can write directly."""
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
            return final, StridedView.contiguous(static_shape(final))
    return path[-1], view


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, matches: dict):
        super().__init__(mod)
        self.matches = matches

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.matches.get(binding.var)
        if found is None:
            super().visit_var_binding_(binding)
            return
        batch, seq_q, seq_kv, dim = found["sizes"]
        kernel = attention.kernel(batch, seq_q, seq_kv, dim, found["scale"], found["causal"], given=found["given"])
        kernel = kernel.without_attr("global_symbol")  # named after its GlobalVar: two attention shapes, two names
        gv = self.builder_.add_func(kernel.with_attrs({"op_pattern": OPAQUE, "tirx.is_scheduled": True}), "fused_attention")
        inputs = [self.visit_expr(found["sources"][name][0]) for name in ("q", "k", "v")]
        inputs = [self.builder_.emit(x) if isinstance(x, relax.Call) else x for x in inputs]  # K transposed
        call = relax.call_tir(gv, inputs, relax.TensorType(found["given"]["out"][0], "float16"))
        self.set_var_remap(binding.var, self.builder_.emit(call, binding.var.name))


@tvm.transform.module_pass(opt_level=0, name="TVMExtFuseAttention")
def fuse_attention(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Replace each spelled-out attention with the fused kernel where the target has wgmma."""
    target = Target.current()
    if target is None or not device_of(target).wgmma:
        return mod
    rewritten = mod
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        chain = Bindings(func)
        matches = {found["sources"]["out"][0]: found for var in chain.value if (found := _match(chain, var)) is not None}
        if not matches:
            continue
        rewriter = _Rewriter(rewritten, matches)
        rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(rewriter.visit_expr(func)))
        rewritten = rewriter.builder_.get()
        LOG.debug("%s: %d attention chain(s) fused", gv.name_hint, len(matches))
    return rewritten
