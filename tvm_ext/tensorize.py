"""Auto-tensorization, after PAI's TensorCore AutoCodeGen (seed 002): find the warp-level matrix
multiply a thread-level schedule expresses, so that it can become tensor-core code.

The schedule writer tiles a matmul for ordinary CUDA threads (schedules/matmul.py); this module
recognises what one warp computes there. Steps, each a function of its own:

1. `match_mma`: the multiply-accumulate `c[i, j] = c[i, j] + cast(a[.]) * cast(b[.])` into a
   register accumulator, its operands low-precision register copies (fp16/bf16 -> fp32, int8 ->
   int32), the loops around it, the blocks that fill `a` and `b` from shared memory and the one
   that drains `c`; and that the 32 lanes of a warp together cover whole m x n x k = 16 x 16 x 16
   tiles: lanes own adjacent column groups (`j = ... + lane * per_lane + jj`), rows do not depend
   on the lane.
2. `infer_fragments`: which operand is matrix_a (the one indexed by the output's row axis) and
   which matrix_b, and the major order of each (where that axis sits in its indices).

No match: None, with the reason at debug level; the function then stays plain CUDA code.
3. `unify_thread_indices`: inside the fragment blocks only (the accumulator's zeroing, the operand
   fills, the multiply-accumulate, the drain), every lane addresses its warp's tile origin:
   threadIdx.x -> 0 (threadIdx.y already numbers warps: blockDim.x is one warp); the
   shared-memory copies keep each thread's own indices.

Still to come (issue 7): loop scaling and emitting the wmma intrinsics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27
from tvm.s_tir.stmt import SBlock, SBlockRealize

from schedules.matmul import WARP, multiply_accumulate

from .variants import substitute

LOG = logging.getLogger(__name__)
TILE = 16  # m = n = k of the wmma shape matched (16x16x16 exists for every type matmul.WIDER lists)


@dataclass
class MmaMatch:
    block: SBlock  # the multiply-accumulate
    c: tirx.Buffer  # register accumulator
    a: TensorLoad  # the two register operands, as loaded by the update
    b: TensorLoad
    row: tirx.Var  # the update's output row and column iterators, and its reduce iterator
    col: tirx.Var
    k: tirx.Var
    warp_tile: tuple  # (m, n, k) one warp computes per step of the reduce loops around the update
    fills: dict  # operand buffer -> the block that copies it from shared memory
    drain: SBlock  # the block that writes the accumulator out
    init: SBlock  # the block that zeroes the accumulator
    lane: tirx.Var  # threadIdx.x, one warp wide


def _blocks(func: tirx.PrimFunc) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (SBlock, found.append), order="pre")
    return found


def _loops_and_bindings(func: tirx.PrimFunc, block: SBlock) -> tuple[list, dict]:
    """(the loops around `block`, outermost first; its iterator -> bound expression)."""
    path: list = []

    def visit(stmt, loops):
        if isinstance(stmt, tirx.For):
            visit(stmt.body, loops + [stmt])
        elif isinstance(stmt, SBlockRealize):
            if stmt.block.same_as(block):
                path.extend(loops)
                path.append(dict(zip([iv.var for iv in stmt.block.iter_vars], stmt.iter_values)))
            else:
                visit(stmt.block.body, loops)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt:
                visit(s, loops)
        elif hasattr(stmt, "body"):
            visit(stmt.body, loops)

    visit(func.body, [])
    return (path[:-1], path[-1]) if path else ([], {})


def _update(block: SBlock):
    """(c store, a load, b load) if `block` is `c = c + cast(a) * cast(b)` over registers, else None."""
    loads = multiply_accumulate(block.body)
    if loads is None or block.body.buffer.scope() != "local" or any(x.source.scope() != "local" for x in loads):
        return None
    return (block.body, *loads)


def _coefficient(expr, var) -> int | None:
    """The constant factor of `var` in `expr` when `expr` is linear in it, else None."""
    coeffs = tvm.sym.detect_linear_equation(expr, [var])
    return int(coeffs[0]) if len(coeffs) == 2 and isinstance(coeffs[0], tirx.IntImm) else None


def _no_match(func_name: str, why: str) -> None:
    LOG.debug("tvm_ext.tensorize: %s stays plain CUDA: %s", func_name, why)


def match_mma(func: tirx.PrimFunc, name: str = "main") -> MmaMatch | None:
    """Step 1: the warp-level mma a thread-level matmul schedule expresses, or None."""
    blocks = _blocks(func)
    updates = [(block, found) for block in blocks if (found := _update(block)) is not None]
    if len(updates) != 1:
        return _no_match(name, f"{len(updates)} multiply-accumulates of low-precision registers (need 1)")
    block, (store, a, b) = updates[0]
    loops, bound = _loops_and_bindings(func, block)
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduce = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if len(spatial) != 2 or len(reduce) != 1 or [str(i) for i in store.indices] != [str(v) for v in spatial]:
        return _no_match(name, "the accumulator is not indexed by the two output axes")
    row, col, k = spatial[0], spatial[1], reduce[0]
    lanes = [lp for lp in loops if lp.thread_binding is not None and lp.thread_binding.thread_tag == "threadIdx.x"]
    serial = [lp for lp in loops if lp.thread_binding is None]
    if len(lanes) != 1 or int(lanes[0].extent) != WARP:
        return _no_match(name, "threadIdx.x does not span exactly one warp")
    lane = lanes[0].loop_var

    def inner_extent(expr):
        """Extent of the serial loops the bound expression steps through with coefficient 1."""
        used = [lp for lp in serial if _coefficient(expr, lp.loop_var) == 1]
        return int(used[-1].extent) if used else 1

    m = inner_extent(bound[row])
    per_lane = inner_extent(bound[col])
    kk = inner_extent(bound[k])
    if _coefficient(bound[row], lane) != 0:
        return _no_match(name, "rows depend on the lane: the warp does not cover a tile")
    if _coefficient(bound[col], lane) != per_lane:
        return _no_match(name, "lanes do not own adjacent column groups")
    tile = (m, WARP * per_lane, kk)
    if any(extent % TILE for extent in tile):
        return _no_match(name, f"warp tile {tile} is not made of {TILE}x{TILE}x{TILE} tiles")
    fills = {x.source: next((blk for blk in blocks if any(w.source.same_as(x.source) for w in blk.writes)
                             and all(r.source.scope() == "shared" for r in blk.reads)), None) for x in (a, b)}
    drain = next((blk for blk in blocks if any(r.source.same_as(store.buffer) for r in blk.reads)
                  and not blk.same_as(block)), None)
    init = next((blk for blk in blocks if not blk.reads and any(w.source.same_as(store.buffer) for w in blk.writes)),
                None)
    if None in fills.values() or drain is None or init is None:
        return _no_match(name, "operands not filled from shared memory, or the accumulator never zeroed or written out")
    return MmaMatch(block, store.buffer, a, b, row, col, k, tile, fills, drain, init, lane)


@dataclass(frozen=True)
class Fragment:
    buffer: tirx.Buffer
    role: str  # "matrix_a" | "matrix_b"
    layout: str  # "row_major" | "col_major"


def infer_fragments(match: MmaMatch) -> tuple[Fragment, Fragment]:
    """Step 2: (matrix_a, matrix_b). matrix_a is the operand indexed by the output's row axis, and
    it is row-major when that axis is its first index; matrix_b is the one indexed by the output's
    column axis, row-major when that axis is its last. The other index must be the reduce axis."""

    def position(load, var):
        uses = [i for i, index in enumerate(load.indices) if _coefficient(index, var) not in (0, None)]
        return uses[0] if len(uses) == 1 else None

    first, second = match.a, match.b
    if position(first, match.row) is None:
        first, second = second, first
    rows_at, cols_at = position(first, match.row), position(second, match.col)
    if rows_at is None or cols_at is None or position(first, match.k) is None or position(second, match.k) is None:
        raise ValueError("operands are not indexed (row, k) and (k, col) in some order")
    return (Fragment(first.source, "matrix_a", "row_major" if rows_at == 0 else "col_major"),
            Fragment(second.source, "matrix_b", "row_major" if cols_at == len(second.indices) - 1 else "col_major"))


def unify_thread_indices(func: tirx.PrimFunc, match: MmaMatch) -> tirx.PrimFunc:
    """Step 3: the fragment blocks' bindings with every lane at its warp's tile origin (lane -> 0).

    threadIdx.y needs no change here: match_mma only accepts a threadIdx.x one warp wide, so
    threadIdx.y already numbers warps (the general rule, ty -> floor(ty / (32 / blockDim.x)) *
    (32 / blockDim.x), is the identity when blockDim.x is 32)."""
    fragment_blocks = [match.init, match.block, match.drain, *match.fills.values()]
    origin = {match.lane: tirx.const(0, match.lane.ty.dtype)}

    def unify(realize):
        if not any(realize.block.same_as(blk) for blk in fragment_blocks):
            return realize
        return SBlockRealize([substitute(v, origin) for v in realize.iter_values], realize.predicate, realize.block)

    return func.with_body(tvm_ffi.structural_map(func.body, (SBlockRealize, unify)))
