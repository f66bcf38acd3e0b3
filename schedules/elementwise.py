"""GPU strategy for elementwise functions: `LANES` adjacent outputs per thread, loaded and stored as vectors.

dlight's fallback gives each thread one element, so each 2- or 4-byte load and store is its own
instruction: the normalisation after ResNet's batch statistics (read x, write y, 205 MB) ran at
1.6 TB/s on an H200. Taken only where every input is read along the output's innermost axis with
stride 1, or not at all (a per-channel scale, a statistic): then the vector accesses are
contiguous; a transpose stays with dlight.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .analysis import const_int

NAME = "elementwise"
THREADS = 256
# Four lanes: wider float32 vectors hit TVM 0.27's broadcast codegen bug (see rows.py); fp16 outputs
# computed in float32 get float32x4 arithmetic.
LANES = 4


class Elementwise(GPUScheduleRule):
    """As a dlight rule, so the pipeline tries it between dlight's reductions and its fallback."""

    def apply(self, func, target, _tunable):
        return apply(func) if isinstance(func, tirx.PrimFunc) and self.is_target_available(target) else None


def apply(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if not infos or any(not info.is_injective() for info in infos):
        return None
    remaining = try_inline(sch, infos)
    if len(remaining) != 1:
        return None
    block = remaining[0].block_rv
    loops = sch.get_loops(block)
    inner = const_int(sch.get(loops[-1]).extent) if loops else None
    if inner is None or inner % LANES or not _reads_along_innermost(sch.get(block)):
        return None
    _, tx, lanes = sch.split(sch.fuse(*loops), [None, THREADS, LANES])
    sch.bind(sch.get_loops(block)[0], "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lanes)
    return sch


def _reads_along_innermost(block) -> bool:
    """Whether every load reads the block's innermost axis as `axis + offset` in its last index and
    nowhere else, or does not read it at all."""
    axis = block.iter_vars[-1].var
    loads = []
    tvm_ffi.structural_walk(block.body, (TensorLoad, loads.append), order="pre")
    for load in loads:
        *outer, last = load.indices
        if any(_uses(index, axis) for index in outer) or (_uses(last, axis) and not _stride_one(last, axis)):
            return False
    return True


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Var, lambda v: found.append(v) if v.same_as(var) else None), order="pre")
    return bool(found)


def _stride_one(expr, var) -> bool:
    """expr is var, or var + (an expression without var)."""
    if isinstance(expr, tirx.Var):
        return expr.same_as(var)
    return isinstance(expr, tirx.Add) and any(
        term.same_as(var) and not _uses(other, var) for term, other in ((expr.a, expr.b), (expr.b, expr.a)))
