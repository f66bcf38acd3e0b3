"""GPU strategy for elementwise functions: `LANES` adjacent outputs per thread, loaded and stored as vectors.

dlight's fallback gives one element per thread, one instruction per 2- or 4-byte access. Taken only
where every input is read contiguously along the output's innermost axis or broadcast; where a
choice depends on the lane or the output is bool, a thread's elements lie THREADS apart instead."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.ir.prim.expr import Select
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .analysis import const_int

NAME = "elementwise"
THREADS = 256
# Four lanes: wider float32 vectors hit TVM 0.27's broadcast codegen bug (see rows.py); fp16 outputs
# computed in float32 get float32x4 arithmetic.
LANES = 4
ROW_VECTORS = 2  # vectors a thread takes in a row of a symbolic-extent function: 16 bytes of halves
IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
VECTORS, SPREAD = "vectors", "spread"  # how a thread takes its LANES elements: adjacent, or THREADS apart


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
    access = _access(sch.get(block)) if inner is not None and inner % LANES == 0 else None
    if access is None:
        return None
    if str(sch.get(block).writes[0].source.dtype) == "bool":  # TVM prints a 4-lane bool store as one 8-byte
        access = SPREAD  # ushort4 at 4-byte steps (misaligned-address fault): lanes apart, unrolled, not vectors
    if _symbolic_rows(sch, loops, inner, spread=access == SPREAD):
        return sch
    if access == VECTORS:
        _, tx, lanes = sch.split(sch.fuse(*loops), [None, THREADS, LANES])
        sch.vectorize(lanes)
    else:  # LANES elements THREADS apart, unrolled: coalesced, and LANES loads in flight per thread
        _, lanes, tx = sch.split(sch.fuse(*loops), [None, LANES, THREADS])
        sch.unroll(lanes)
    sch.bind(sch.get_loops(block)[0], "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch


def _symbolic_rows(sch: s_tir.Schedule, loops: list, inner: int, spread: bool = False) -> bool:
    """Where an outer extent is symbolic (a KV cache's length): rows of the static innermost axis,
    ROW_VECTORS vectors of LANES per thread (adjacent, unrolled), several rows a block, so a thread
    splits its row index into the outer axes once (64-bit divisions by symbolic extents, which once
    per element cost more than the copy: a cache append ran at 0.8 TB/s, once per half4 at 2.4).
    LANES-wide vectors, not 16 bytes: 8-lane half vectors failed CUDA codegen on a squeezed slice of
    BERT's packed projection. With `spread` (a choice per lane, a bool output), a thread's LANES
    elements of its row lie a row's threads apart, unrolled (a rotary's rotate_half at a symbolic
    length took twice the time of its static build, dividing per element). Scheduled in place;
    False where not taken."""
    vectors = 1 if spread or inner % (ROW_VECTORS * LANES) else ROW_VECTORS
    per_row = inner // (vectors * LANES)
    if len(loops) < 2 or all(const_int(sch.get(loop).extent) is not None for loop in loops[:-1]) or THREADS % per_row:
        return False
    bx, row_in_block = sch.split(sch.fuse(*loops[:-1]), [None, THREADS // per_row])
    if spread:
        lanes, columns = sch.split(loops[-1], [LANES, None])
        sch.reorder(bx, row_in_block, columns, lanes)
        sch.unroll(lanes)
    else:
        columns, pair, vector = sch.split(loops[-1], [None, vectors, LANES])
        sch.reorder(bx, row_in_block, columns, pair, vector)
        sch.unroll(pair)
        sch.vectorize(vector)
    sch.bind(bx, "blockIdx.x")
    sch.bind(sch.fuse(row_in_block, columns), "threadIdx.x")
    return True


def _access(block) -> str | None:
    """VECTORS when each run of LANES outputs along the innermost axis (from a multiple of LANES)
    reads every input at LANES adjacent elements of its last dimension, or at one element; SPREAD
    when so but a choice depends on the lane (the halves of a rotary's rotate_half: TVM would loop
    over a vector's lanes); None when some read is not contiguous. With the axis written
    `LANES * q + lane`, each load's index is simplified knowing every iterator's range: its other
    indices must not depend on the lane, and its last index must be the lane plus something that
    does not. So `v`, `v + c`, and the `v % 64` and `v // 64` of a head merge (attention's
    [batch * heads, seq, 64] -> [batch * seq, heads * 64]) pass; a transpose of the axis does not."""
    axis, dom = block.iter_vars[-1].var, block.iter_vars[-1].dom
    dtype, extent = str(dom.extent.ty), const_int(dom.extent)
    q, lane = tirx.Var("q", dtype), tirx.Var("lane", dtype)
    analyzer = tvm.sym.Analyzer()
    for iv in block.iter_vars[:-1]:
        analyzer.bind(iv.var, iv.dom)
    analyzer.bind(q, tvm.ir.Range.from_min_extent(tirx.const(0, dtype), tirx.const(extent // LANES, dtype)))
    analyzer.bind(lane, tvm.ir.Range.from_min_extent(tirx.const(0, dtype), tirx.const(LANES, dtype)))
    def per_lane(expr):  # expr with the axis written LANES * q + lane, simplified
        return analyzer.simplify(tvm_ffi.structural_map(expr, (tirx.Var, lambda v: position if v.same_as(axis) else v)))

    position = q * LANES + lane

    loads, conditions = [], []
    tvm_ffi.structural_walk(block.body, (TensorLoad, loads.append), order="pre")
    tvm_ffi.structural_walk(block.body, (Select, lambda x: conditions.append(x.condition)), order="pre")
    tvm_ffi.structural_walk(block.body, (Call, lambda x: x.op.same_as(IF_THEN_ELSE) and conditions.append(x.args[0])),
                            order="pre")
    for load in loads:
        if not load.indices:  # a 0-d operand (a scalar): one element for every lane
            continue
        *outer, last = (per_lane(index) for index in load.indices)
        if any(_uses(index, lane) for index in outer) or _uses(last, lane) and _uses(analyzer.simplify(last - lane), lane):
            return None
    return SPREAD if any(_uses(per_lane(condition), lane) for condition in conditions) else VECTORS


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Var, lambda v: found.append(v) if v.same_as(var) else None), order="pre")
    return bool(found)
