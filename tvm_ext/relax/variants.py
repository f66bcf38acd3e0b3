"""Call-site rewrites for scheduled kernels: run-time variant choice and zero-filled state.

A function with symbolic dims may get several kernels, each with a condition on those dims; its
call sites become host-side `if`s (a compare, not a kernel). Kernels that keep state between
launches list it in ZEROED_INPUTS and get zero-filled constants, which they leave zeroed."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvm_ext.schedules.analysis import substitute
from tvm_ext.schedules.contracts import WIDTH_IN_VECTORS, ZEROED_INPUTS

from .bindings import CALL_TIR



def _tensor_types(ty) -> list:
    return list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]


def _call_args(call: relax.Call) -> list:
    """The tensors a call_tir passes (its second argument, a tuple or a single expression)."""
    return list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else [call.args[1]]


def _shape_bindings(func: tirx.PrimFunc, call: relax.Call) -> dict:
    """Map the PrimFunc's symbolic dims to the caller's shape expressions: those that are a tensor's
    dim, and the scalar parameters the call passes (a dim only inside an expression: BERT's
    2 x seq rows)."""
    args = _call_args(call)
    types = [a.ty for a in args if isinstance(a.ty, relax.TensorType)] + _tensor_types(call.ty)
    buffers = [p for p in func.params if hasattr(p, "shape")]
    scalars = [v for a in args if not isinstance(a.ty, relax.TensorType)  # the dims passed as values
               for v in (a.values if isinstance(a, relax.ShapeExpr) else [a])]
    bindings = dict(zip([p for p in func.params if not hasattr(p, "shape")], scalars))
    for param, ty in zip(buffers, types):
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            continue
        for dim, value in zip(param.shape, ty.shape.values):
            if isinstance(dim, tirx.Var):
                bindings[dim] = value
    return bindings


@mutator
class _DispatchCallSites(PyExprMutator):
    """Each call_tir of a function in the table becomes an if-chain over its kernels."""

    def __init__(self, mod: tvm.IRModule, table: dict):
        super().__init__(mod)
        self.mod_ = mod
        self.table = table  # GlobalVar name -> [(condition over the PrimFunc's vars | None, variant GlobalVar)]

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(CALL_TIR)):
            return call
        variants = self.table.get(call.args[0].name_hint)
        if not variants:
            return call
        bindings = _shape_bindings(self.mod_[call.args[0]], call)
        *guarded, (_, fallback) = variants
        expr = relax.SeqExpr([], self._call(call, fallback, bindings))
        for condition, gv in reversed(guarded):
            expr = relax.SeqExpr([], relax.If(relax.prim_value(substitute(condition, bindings)),
                                              relax.SeqExpr([], self._call(call, gv, bindings)), expr))
        return expr.body

    def _call(self, call, gv, bindings: dict):
        attrs = self.mod_[gv].attrs or {}
        args = _call_args(call)
        args += [relax.const(np.zeros([int(d) for d in shape], str(dtype))) for shape, dtype in attrs.get(ZEROED_INPUTS, [])]
        if WIDTH_IN_VECTORS in attrs and WIDTH_IN_VECTORS not in (self.mod_[call.args[0]].attrs or {}):
            # the row width as a count of vectors (schedules.dispatch.in_vectors), unless passed already
            name, lanes = attrs[WIDTH_IN_VECTORS]
            width = next(value for var, value in bindings.items() if var.name == name)
            args.append(relax.prim_value(tirx.floordiv(width, tirx.const(int(lanes), str(width.ty)))))
        return relax.Call(call.op, [gv, relax.Tuple(args)] + list(call.args[2:]), call.attrs, call.ty_args)


def rewrite_call_sites(mod: tvm.IRModule, table: dict) -> tvm.IRModule:
    """Rewrite the call sites of each function named in `table`.

    `table`: function name -> [(condition, variant GlobalVar), ..., (None, fallback GlobalVar)],
    conditions over the original PrimFunc's symbolic dims, tried in order; a single entry just
    adds the zero-filled inputs its kernel asks for.
    """
    if not table:
        return mod
    rewriter = _DispatchCallSites(mod, table)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewriter.visit_expr(func)
    return mod
