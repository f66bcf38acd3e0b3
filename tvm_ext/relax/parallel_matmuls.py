"""Linear layers that read the same input, with constant weights, become one wider matmul (GPUs).

Joined, the output has enough 128 x 256 tiles for two waves of the wgmma template's fastest kernel
and the input is read once; layers of a static row count are joined only where that holds
(smaller joins are slower), or where they are one row (a GEMV: one launch, one tail, for all).
Layers of a symbolic row count (a sequence length, a decoding batch) are joined always: their
kernel for one row is a GEMV and those for more rows gain the tiles. Each layer's result becomes a
slice of the joint output. TVM's CombineParallelMatmul does not fit:
it needs one input variable and gives FuseOps a tuple output. See docs/design.md#warpgroup-matmuls-wgmma."""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import GenericConst  # relax constants in 0.27
from tvm.target import Target

from tvm_ext.schedules.contracts import WGMMA_TYPES, WIDE_TILE, WIDE_TILE_WAVES
from tvm_ext.schedules.device import device_of

from . import gated_linears
from .bindings import Bindings, op_name, shape_of

LOG = logging.getLogger(__name__)


def _weight(value, chain: Bindings) -> np.ndarray | None:
    """W ([n, k]) of a matmul's right operand permute_dims(W) with W constant, else None."""
    rhs = chain.producer(value) if isinstance(value, relax.Var) else value
    if op_name(rhs) != "relax.permute_dims" or not isinstance(rhs.args[0], GenericConst):
        return None
    axes = rhs.attrs.axes
    if axes is not None and [int(a) for a in axes] != [1, 0]:
        return None
    weight = rhs.args[0].value.numpy()
    return weight if weight.ndim == 2 else None


def _linears(func: relax.Function) -> dict:
    """{input key: [(astype var, matmul var, weight)]} of func's `astype(matmul(x, W^T), t)`
    bindings with 2-D inputs (K static) of one wgmma operand type t (fp16, bf16), the matmul used
    only by its astype; the key is x, or (x, shape) for a reshape of x, so the frontend's per-layer
    reshapes of one input group together."""
    chain = Bindings(func)
    groups: dict = {}
    for var, cast in chain.value.items():
        dtype = str(cast.ty.dtype) if op_name(cast) == "relax.astype" else None
        if dtype not in WGMMA_TYPES or not isinstance(cast.args[0], relax.Var):
            continue
        mm = chain.producer(cast.args[0])
        if op_name(mm) != "relax.matmul" or not chain.only_use(cast.args[0]) or str(mm.args[0].ty.dtype) != dtype:
            continue
        weight, lhs = _weight(mm.args[1], chain), mm.args[0]
        shape = shape_of(lhs)
        if weight is None or str(weight.dtype) != dtype or shape is None or len(shape) != 2 \
                or weight.shape[1] != shape[1]:
            continue
        source = chain.producer(lhs)
        key = (source.args[0], str(shape)) if op_name(source) == "relax.reshape" else lhs
        groups.setdefault(key, []).append((var, cast.args[0], weight))
    return {key: group for key, group in groups.items() if len(group) > 1}


def worth_joining(rows: int, columns: int, sm_count: int) -> bool:
    """Whether a [rows, columns] output gives the waves of large tiles the wgmma heuristic wants
    before it takes them."""
    block_m, block_n = WIDE_TILE
    return -(-rows // block_m) * -(-columns // block_n) >= WIDE_TILE_WAVES * sm_count


def _joins(rows, columns: int, sm_count: int) -> bool:
    """Whether layers of `rows` rows (an int, or symbolic) and `columns` output columns in all are
    joined (see the module docstring)."""
    return not isinstance(rows, int) or rows == 1 or worth_joining(rows, columns, sm_count)


@relax.expr_functor.mutator
class _Combiner(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, groups: dict, interleave: bool):
        super().__init__(mod)
        self.first = {group[0][1]: group for group in groups.values()}  # first matmul of a group -> group
        self.interleave = interleave  # pairs of one width in alternating runs (gated_linears.py)
        self.views = {}  # astype var -> its layer's columns of the joint output

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        group = self.first.get(binding.var)
        if group is not None:  # the joint matmul stands where the group's first one stood
            weights = [w for *_, w in group]
            paired = self.interleave and gated_linears.interleavable(weights)  # each row class's template writes a gated epilogue
            lhs = self.visit_expr(binding.value.args[0])
            weight = gated_linears.interleaved(weights) if paired else np.concatenate(weights)
            joint = self.builder_.emit(relax.op.astype(self.builder_.emit(relax.op.matmul(
                lhs, self.builder_.emit(relax.op.permute_dims(relax.const(weight), [1, 0])), out_dtype="float32")),
                str(weight.dtype)))
            rows, offset = shape_of(joint)[0], 0
            for half, (cast_var, _, w) in enumerate(group):
                self.views[cast_var] = gated_linears.half_view(joint, half, rows, w.shape[0]) if paired else \
                    relax.op.strided_slice(joint, axes=[1], begin=[offset], end=[offset + w.shape[0]], assume_inbound=True)
                offset += w.shape[0]
            return
        view = self.views.get(binding.var)
        if view is None:
            super().visit_var_binding_(binding)
            return
        self.set_var_remap(binding.var, self.builder_.emit(view, binding.var.name))


@tvm.transform.module_pass(opt_level=0, name="TVMExtCombineParallelLinears")
def combine_parallel_linears(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Join the Linear layers of each function that share an input (see the module docstring)."""
    target = Target.current()
    device = device_of(target) if target is not None else None
    if device is None or not device.is_gpu:
        return mod
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        groups = {key: group for key, group in _linears(func).items()
                  if _joins(shape_of(group[0][1])[0], sum(w.shape[0] for *_, w in group), device.sm_count)}
        if not groups:
            continue
        combiner = _Combiner(mod, groups, device.wgmma)
        combiner.builder_.update_func(gv, relax.analysis.remove_all_unused(combiner.visit_expr(func)))
        mod = combiner.builder_.get()  # a new module: the caller's is left as it was
        LOG.debug("%s: %s Linear layers joined", gv.name_hint, " + ".join(str(len(g)) for g in groups.values()))
    return mod
