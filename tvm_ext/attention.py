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

from .layout_rewrites import shape_of
from .legalize import legalizations

LOG = logging.getLogger(__name__)
PASSING = ("relax.astype", "relax.reshape", "relax.broadcast_to")  # ops that carry the scores unchanged
OPAQUE = 8  # relax's OpPatternKind kOpaque: FuseOps never fuses it with its neighbours


def _op(expr) -> str:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else ""


def _shape(expr) -> list[int] | None:
    """A tensor's dims when all are static."""
    if not isinstance(expr.ty, relax.TensorType) or not isinstance(expr.ty.shape, relax.ShapeExpr):
        return None
    dims = shape_of(expr)
    return dims if dims is not None and all(isinstance(d, int) for d in dims) else None


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


class _Chain:
    """The values of one function: what each variable is bound to and how many bindings use it."""

    def __init__(self, func: relax.Function):
        self.value, self.uses = {}, {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.value[binding.var] = binding.value
                    for var in relax.analysis.free_vars(binding.value):
                        self.uses[var] = self.uses.get(var, 0) + 1
        for var in relax.analysis.free_vars(func.body.body):
            self.uses[var] = self.uses.get(var, 0) + 1

    def only_use(self, var) -> bool:
        return self.uses.get(var, 0) == 1

    def producer(self, expr):
        return self.value.get(expr) if isinstance(expr, relax.Var) else None

    def upstream(self, var):
        """From `var`, up through single-use astype/reshape/broadcast_to bindings to where the
        scores were last changed."""
        while _op(self.producer(var)) in PASSING and self.only_use(var):
            var = self.producer(var).args[0]
        return var


def _scalar(expr) -> float | None:
    if isinstance(expr, GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _is_causal(chain: _Chain, mask, rows: int, cols: int) -> bool:
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
    try:  # FoldConstant leaves `full` (no inputs) alone, so run it: a handful of tiny CPU kernels
        values = VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"]().numpy().astype("float32")
    except tvm.error.TVMError as err:
        LOG.debug("attention mask not evaluated (%s): left as it is", err)
        return False
    if values.ndim > 2 and all(d == 1 for d in values.shape[:-2]):  # a [1, 1, rows, cols] mask
        values = values.reshape(values.shape[-2:])
    if values.ndim > 2:
        return False
    values = np.broadcast_to(values, (rows, cols))
    upper = np.triu(np.ones((rows, cols), bool), 1)
    return bool(np.all(values[~upper] == 0) and np.all(np.isneginf(values[upper])))


def _match(chain: _Chain, final) -> dict | None:
    """The attention chain ending in the astype-to-fp16 `final`, or None."""
    value = chain.value[final]
    if _op(value) != "relax.astype" or _dtype(value) != "float16":
        return None
    pv = chain.producer(value.args[0])
    if _op(pv) != "relax.matmul" or not chain.only_use(value.args[0]):
        return None
    p3, v3 = pv.args
    softmax_out = chain.upstream(p3)
    softmax = chain.producer(softmax_out)
    if _op(softmax) != "relax.nn.softmax" or not chain.only_use(softmax_out) \
            or int(softmax.attrs.axis) not in (-1, len(_shape(softmax_out) or []) - 1):
        return None
    scores = chain.upstream(softmax.args[0])
    mask, causal = None, False
    if _op(chain.producer(scores)) == "relax.add" and chain.only_use(scores):
        lhs, mask = chain.producer(scores).args
        scores = chain.upstream(lhs)
    scaling = chain.producer(scores)
    if _op(scaling) not in ("relax.divide", "relax.multiply") or not chain.only_use(scores) \
            or _scalar(scaling.args[1]) is None:
        return None
    scale = _scalar(scaling.args[1])
    scale = 1.0 / scale if _op(scaling) == "relax.divide" else scale
    mm_out = chain.upstream(scaling.args[0])
    qk = chain.producer(mm_out)
    if _op(qk) != "relax.matmul" or not chain.only_use(mm_out):
        return None
    q3, kt3 = qk.args
    shapes = [_shape(x) for x in (q3, kt3, v3, final)]
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
    if not attention.fits(batch, seq_q, seq_kv, dim, causal):
        return None
    return {"q": q3, "k": _keys(chain, kt3, batch), "v": v3, "sizes": (batch, seq_q, seq_kv, dim), "scale": scale,
            "causal": causal}


def _keys(chain: _Chain, kt3, batch: int) -> tuple:
    """How to get K [batch, seq, dim] from K^T [batch, dim, seq]: ("reshape", k) where K^T is a
    transpose of the last two axes of k [..., seq, dim] (the frontend's k.transpose(-1, -2); reading
    k itself spares a transposed copy), else ("transpose", kt3)."""
    expr = kt3
    while _op(chain.producer(expr)) in ("relax.reshape", "relax.broadcast_to"):
        expr = chain.producer(expr).args[0]
    value = chain.producer(expr)
    if _op(value) == "relax.permute_dims" and value.attrs.axes is not None:
        axes, shape = [int(a) for a in value.attrs.axes], _shape(value.args[0])
        rank = len(axes)
        if axes == [*range(rank - 2), rank - 1, rank - 2] and shape and int(np.prod(shape[:-2])) == batch:
            return "reshape", value.args[0]
    return "transpose", kt3


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
        kernel = attention.kernel(batch, seq_q, seq_kv, dim, found["scale"], found["causal"])
        gv = self.builder_.add_func(kernel.with_attrs({"op_pattern": OPAQUE, "tirx.is_scheduled": True}), "fused_attention")
        how, keys = found["k"]
        keys = self.visit_expr(keys)
        keys = self.builder_.emit(relax.op.reshape(keys, [batch, seq_kv, dim]) if how == "reshape"
                                  else relax.op.permute_dims(keys, [0, 2, 1]))
        call = relax.call_tir(gv, [self.visit_expr(found["q"]), keys, self.visit_expr(found["v"])],
                              relax.TensorType([batch, seq_q, dim], "float16"))
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
        chain = _Chain(func)
        matches = {var: found for var in chain.value if (found := _match(chain, var)) is not None}
        if not matches:
            continue
        rewriter = _Rewriter(rewritten, matches)
        new_func = rewriter.visit_expr(func)
        rewritten = rewriter.builder_.get()
        rewritten[gv] = relax.analysis.remove_all_unused(new_func)
        LOG.debug("%s: %d attention chain(s) fused", gv.name_hint, len(matches))
    return rewritten
