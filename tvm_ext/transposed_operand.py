"""`q @ k.transpose(-1, -2)` as one matmul that reads k as it is stored.

PyTorch attention multiplies by a transposed key; TVM's frontend writes it as permute_dims (then
broadcast_to and reshape to the batched 3-D shape), and FuseOps puts that transpose into the
kernel producing k, whose writes then stride by the sequence length (LLaMA's rotary kernel: 230
us at seq 2048 on an H200, against 30 us for the same work on q). Here the matmul reads the
untransposed k instead, as a `[batch, n, k]` operand: the matmul template and the
auto-tensorization pass take it as a col-major matrix_b.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator


def matmul_nt_te(a: te.Tensor, b: te.Tensor, out_dtype: str) -> te.Tensor:
    """C[..., i, j] = sum_k A[..., i, k] * B[..., j, k], with B's batch dims equal to A's."""
    k = te.reduce_axis((0, a.shape[-1]), name="k")
    return te.compute((*a.shape[:-1], b.shape[-2]), lambda *i: te.sum(
        a[(*i[:-1], k)].astype(out_dtype) * b[(*i[:-2], i[-1], k)].astype(out_dtype), axis=k), name="matmul")


def _op_name(expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _shape(expr) -> list | None:
    shape = expr.ty.shape
    return None if shape is None else [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in shape.values]


@mutator
class _ReadTransposedOperand(PyExprMutator):
    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if _op_name(call) != "relax.matmul" or len(_shape(call.args[0]) or []) < 3:
            return call
        source = self._untransposed(call.args[1])
        if source is None:
            return call
        want = _shape(call.args[1])  # [batch, k, n]: the untransposed source holds it as [batch, n, k]
        if _shape(call.args[0])[:-2] != want[:-2]:
            return call
        stored = self.builder_.emit(relax.op.reshape(source, [*want[:-2], want[-1], want[-2]]))
        return self.builder_.call_te(matmul_nt_te, call.args[0], stored, str(call.attrs.out_dtype or call.ty.dtype),
                                     primfunc_name_hint="matmul_nt")

    def _untransposed(self, expr):
        """x when `expr` is permute_dims(x) swapping the last two axes, seen through reshapes that
        only merge leading dims and broadcast_to that changes nothing; else None."""
        while isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            name = _op_name(bound)
            if name == "relax.permute_dims":
                rank = len(_shape(bound) or [])
                axes = [int(a) for a in bound.attrs.axes] if bound.attrs.axes is not None else None
                swap = list(range(rank - 2)) + [rank - 1, rank - 2]
                return bound.args[0] if axes == swap and rank >= 2 else None
            if name == "relax.broadcast_to" and _shape(bound) == _shape(bound.args[0]):
                expr = bound.args[0]
            elif name == "relax.reshape" and (_shape(bound) or [None])[-2:] == (_shape(bound.args[0]) or [0])[-2:]:
                expr = bound.args[0]
            else:
                return None
        return None


@tvm.transform.module_pass(opt_level=0, name="TVMExtReadTransposedOperand")
def read_transposed_operand(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Matmuls by a transposed batched operand read it untransposed; the transposes left unused go."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and _has_batched_matmul(func):
            rewriter = _ReadTransposedOperand(mod)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            mod = rewriter.builder_.get()
    return relax.transform.DeadCodeElimination()(mod)


def _has_batched_matmul(func) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (relax.Call, lambda c: found.append(c) if _op_name(c) == "relax.matmul"
                                        and len(_shape(c.args[0]) or []) >= 3 else None), order="pre")
    return bool(found)
