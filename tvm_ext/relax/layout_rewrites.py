"""Relax rewrites before legalization that leave FuseOps and the templates better work.

`q @ k^T` reads k as stored (else the transpose lands in k's producer, whose writes then stride);
on sm_90a `x @ W.T` reads W as stored, [n, k], when the wgmma template takes the matmul, and on any
GPU when x is a single row (a GEMV: each output reads one contiguous row of W) or a symbolic number
of rows (one of its kernels is that GEMV); and an
activation or residual add after a reshape moves before it, into the matmul's epilogue (FuseOps
stops at reshapes). Measured: see docs/design.md#warpgroup-matmuls-wgmma."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from tvm_ext.schedules.contracts import WGMMA_TYPES
from tvm_ext.schedules.device import device_of

from .bindings import op_name, shape_of, static_shape
from .split_k import MAX_ROWS

ACTIVATIONS = {"relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.nn.relu", "relax.sigmoid",
               "relax.tanh"}


def matmul_nt_te(a: te.Tensor, b: te.Tensor, out_dtype: str) -> te.Tensor:
    """C[..., i, j] = sum_k A[..., i, k] * B[..., j, k], with B's batch dims equal to A's."""
    k = te.reduce_axis((0, a.shape[-1]), name="k")
    return te.compute((*a.shape[:-1], b.shape[-2]), lambda *i: te.sum(
        a[(*i[:-1], k)].astype(out_dtype) * b[(*i[:-2], i[-1], k)].astype(out_dtype), axis=k), name="matmul")


@mutator
class _ReadTransposedOperand(PyExprMutator):
    def __init__(self, mod, wgmma: bool = False, gpu: bool = False):
        super().__init__(mod)
        self.wgmma, self.gpu = wgmma, gpu

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if op_name(call) != "relax.matmul":
            return call
        batched = len(shape_of(call.args[0]) or []) >= 3
        if not batched and not (self.wgmma and _wgmma_sized(call) or self.gpu and (_single_row(call) or _any_rows(call))):
            return call
        source = self._untransposed(call.args[1])
        if source is None:
            return call
        want = shape_of(call.args[1])  # [batch, k, n]: the untransposed source holds it as [batch, n, k]
        if shape_of(call.args[0])[:-2] != want[:-2]:
            return call
        stored = self.builder_.emit(relax.op.reshape(source, [*want[:-2], want[-1], want[-2]])) if batched else source
        return self.builder_.call_te(matmul_nt_te, call.args[0], stored, str(call.attrs.out_dtype or call.ty.dtype),
                                     primfunc_name_hint="matmul_nt")

    def _untransposed(self, expr):
        """x when `expr` is permute_dims(x) swapping the last two axes, seen through reshapes that
        only merge leading dims and broadcast_to that changes nothing; else None."""
        while isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            name = op_name(bound)
            if name == "relax.permute_dims":
                rank = len(shape_of(bound) or [])
                axes = [int(a) for a in bound.attrs.axes] if bound.attrs.axes is not None else list(range(rank))[::-1]
                swap = list(range(rank - 2)) + [rank - 1, rank - 2]
                return bound.args[0] if axes == swap and rank >= 2 else None
            if name == "relax.broadcast_to" and shape_of(bound) == shape_of(bound.args[0]):
                expr = bound.args[0]
            elif name == "relax.reshape" and (shape_of(bound) or [None])[-2:] == (shape_of(bound.args[0]) or [0])[-2:]:
                expr = bound.args[0]
            else:
                return None
        return None


def _wgmma_sized(call) -> bool:
    """Whether a 2-D matmul is one the wgmma template takes whole: fp16 or bf16 into float32, static sizes,
    K and N of whole 64-element tiles, more rows than split-K's few (those keep TVM's legalization)."""
    sa, sb = static_shape(call.args[0]), static_shape(call.args[1])
    return sa is not None and sb is not None and len(sa) == len(sb) == 2 and str(call.args[0].ty.dtype) in WGMMA_TYPES \
        and str(call.attrs.out_dtype) == "float32" and sa[0] > MAX_ROWS and sa[1] % 64 == 0 and sb[1] % 64 == 0


def _single_row(call) -> bool:
    """Whether a 2-D matmul is a GEMV: one row of x, static sizes (dlight's GEMV rule then reads
    the weight as stored at bandwidth; a transposed weight is read down its columns)."""
    sa, sb = static_shape(call.args[0]), static_shape(call.args[1])
    return sa is not None and sb is not None and len(sa) == len(sb) == 2 and sa[0] == 1


def _any_rows(call) -> bool:
    """Whether a 2-D matmul has a symbolic row count (a sequence length) and static K and N: one of
    its kernels serves a single row (a GEMV, see _single_row), the others read an [n, k] weight as
    well as a [k, n] one."""
    sa, sb = shape_of(call.args[0]), static_shape(call.args[1])
    return sa is not None and sb is not None and len(sa) == len(sb) == 2 and not isinstance(sa[0], int) \
        and isinstance(sa[1], int)


@tvm.transform.module_pass(opt_level=0, name="TVMExtReadTransposedOperand")
def read_transposed_operand(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Matmuls by a transposed batched operand read it untransposed; on wgmma targets, so do the
    2-D ones by a transposed [n, k] weight (see the module docstring); the transposes left unused go."""
    target = Target.current()
    wgmma, gpu = (device_of(target).wgmma, device_of(target).is_gpu) if target is not None else (False, False)
    return _rewrite(mod, lambda m: _ReadTransposedOperand(m, wgmma, gpu), lambda f: gpu or _has_batched_matmul(f))


def _rewrite(mod: tvm.IRModule, make_rewriter, wanted) -> tvm.IRModule:
    """`mod` with each Relax function for which `wanted(func)` rewritten, then dead bindings removed."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and wanted(func):
            rewriter = make_rewriter(mod)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            mod = rewriter.builder_.get()
    return relax.transform.DeadCodeElimination()(mod)


def _has_batched_matmul(func) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (relax.Call, lambda c: found.append(c) if op_name(c) == "relax.matmul"
                                        and len(shape_of(c.args[0]) or []) >= 3 else None), order="pre")
    return bool(found)


@mutator
class _ActivationBeforeReshape(PyExprMutator):
    """Also folds a reshape of a reshape into one (none when it restores the shape): the frontend
    reshapes the activation back to 2-D rows for the next Linear, which left a copy kernel."""

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if op_name(call) == "relax.add":
            return self._residual_before_reshape(call)
        bound = self._bound(call.args[0]) if call.args else None
        if op_name(bound) != "relax.reshape" or not isinstance(bound.args[0], relax.Var):
            return call
        source = bound.args[0]
        if op_name(call) == "relax.reshape":
            return source if shape_of(call) == shape_of(source) else relax.op.reshape(source, call.args[1])
        if op_name(call) not in ACTIVATIONS or len(call.args) != 1:
            return call
        return relax.op.reshape(self.builder_.emit(relax.Call(call.op, [source], call.attrs)), bound.args[1])

    def _residual_before_reshape(self, call):
        """`r + reshape(y)` (either order, no broadcasting) as `reshape(y + reshape(r))` where y is a
        matmul's product."""
        for reshaped, residual in (call.args, call.args[::-1]):
            bound = self._bound(reshaped)
            if op_name(bound) == "relax.reshape" and self._produced_by_matmul(bound.args[0]) \
                    and shape_of(residual) == shape_of(call) == shape_of(reshaped):
                source = bound.args[0]
                other = self.builder_.emit(relax.op.reshape(residual, shape_of(source)))
                return relax.op.reshape(self.builder_.emit(relax.op.add(source, other)), bound.args[1])
        return call

    def _bound(self, expr):
        """What variable `expr` is bound to; None for anything else."""
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else None

    def _produced_by_matmul(self, expr) -> bool:
        """Whether `expr` is a matmul's result, or its cast (the frontend rounds the product)."""
        bound = self._bound(expr)
        if op_name(bound) == "relax.astype":
            return self._produced_by_matmul(bound.args[0])
        return op_name(bound) == "relax.matmul"


@tvm.transform.module_pass(opt_level=0, name="TVMExtActivationBeforeReshape")
def activation_before_reshape(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every unary activation of a reshaped tensor, and every residual added to a reshaped matmul,
    applied before the reshape instead."""
    return _rewrite(mod, _ActivationBeforeReshape, lambda func: True)
