"""Auto-tensorization after PAI's TensorCore AutoCodeGen: a thread-level matmul schedule becomes WMMA code.

`auto_tensorize` (PrimFunc pass `AutoTensorize`) matches what one warp of schedules/matmul.py
computes (`match_mma`), infers operand roles (`infer_fragments`), makes the fragment blocks address
the warp tile (`unify_thread_indices`, `scale_lane_loops`) and emits TVM's WMMA intrinsics
(`emit_wmma`). No match leaves plain CUDA. See docs/design.md#auto-tensorization-mmasync."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27
from tvm.s_tir.stmt import SBlock, SBlockRealize

from tvm_ext.schedules.analysis import multiply_accumulate, substitute
from tvm_ext.schedules.contracts import TENSOR_CORE_DTYPES, WARP

from .intrinsics import import_tensor_intrinsics

LOG = logging.getLogger(__name__)
TILE = 16  # m = n = k of the wmma shape matched
SHARED = ("shared", "shared.dyn")


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
    LOG.debug("tvm_ext.tir.tensorize: %s stays plain CUDA: %s", func_name, why)


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
    if len(spatial) < 2 or len(reduce) != 1 or [str(i) for i in store.indices] != [str(v) for v in spatial]:
        return _no_match(name, "the accumulator is not indexed by the output axes")
    *batch, row, col = spatial
    k = reduce[0]
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
    if any(_coefficient(bound[b], lp.loop_var) != 0 for b in batch for lp in [*lanes, *serial]):
        return _no_match(name, "a batch axis varies inside the warp tile")
    if per_lane == 1:
        return _no_match(name, "each lane owns one column: no loop to widen to the warp's columns")
    if _coefficient(bound[col], lane) != per_lane:
        return _no_match(name, "lanes do not own adjacent column groups")
    tile = (m, WARP * per_lane, kk)
    if any(extent % TILE for extent in tile):
        return _no_match(name, f"warp tile {tile} is not made of {TILE}x{TILE}x{TILE} tiles")
    fills = {x.source: next((blk for blk in blocks if any(w.source.same_as(x.source) for w in blk.writes)
                             and all(r.source.scope() in SHARED for r in blk.reads)), None) for x in (a, b)}
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
    it is row-major when that axis is its next-to-last index; matrix_b is the one indexed by the
    output's column axis, row-major when that axis is its last. The other index of the two must be
    the reduce axis (batch axes, if any, come first)."""

    def position(load, var):
        uses = [i for i, index in enumerate(load.indices) if _coefficient(index, var) not in (0, None)]
        return uses[0] if len(uses) == 1 else None

    first, second = match.a, match.b
    if position(first, match.row) is None:
        first, second = second, first
    rows_at, cols_at = position(first, match.row), position(second, match.col)
    if rows_at is None or cols_at is None or position(first, match.k) is None or position(second, match.k) is None:
        raise ValueError("operands are not indexed (row, k) and (k, col) in some order")
    return (Fragment(first.source, "matrix_a", "row_major" if rows_at == len(first.indices) - 2 else "col_major"),
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


def scale_lane_loops(func: tirx.PrimFunc, match: MmaMatch) -> tirx.PrimFunc:
    """Step 4 (after step 3 put every lane at the warp's origin): the serial loops of the fragment
    blocks that stepped through one lane's columns (coefficient 1 in a binding that holds the lane)
    run over all 32 lanes' columns."""
    per_lane = match.warp_tile[1] // WARP
    owned = set()
    for blk in (match.init, match.block, match.drain, *match.fills.values()):
        loops, bound = _loops_and_bindings(func, blk)
        for expr in bound.values():
            if _coefficient(expr, match.lane) not in (0, None):
                owned |= {lp.loop_var for lp in loops if lp.thread_binding is None and int(lp.extent) == per_lane
                          and _coefficient(expr, lp.loop_var) == 1}
    unified = unify_thread_indices(func, match)

    def scale(loop):
        if loop.loop_var not in owned:
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent * WARP, loop.kind, loop.body, loop.thread_binding,
                        loop.annotations)

    return unified.with_body(tvm_ffi.structural_map(unified.body, (tirx.For, scale)))


def _intrinsics(match: MmaMatch, fragments: tuple) -> dict:
    """The registered WMMA intrinsics for the operands' dtype and matrix_b's major order."""
    import_tensor_intrinsics()
    from tvm.s_tir.tensor_intrin import cuda  # noqa: PLC0415

    shared = next(iter(match.fills.values())).reads[0].source.scope()
    out = match.drain.writes[0].source.scope()  # global, or a shared stage before an epilogue
    return cuda.get_wmma_intrin_group(shared, out, str(match.a.source.dtype), str(match.c.dtype),
                                      fragments[1].layout == "col_major")


def emit_wmma(func: tirx.PrimFunc, match: MmaMatch, fragments: tuple) -> tirx.PrimFunc:
    """Step 5 on a function after step 4: 16 x 16 x 16 steps, each fragment block one intrinsic."""
    intrinsics = _intrinsics(match, fragments)
    # unchecked: a padded template's copy-out block is bounds-checked (T.where), and TVM then cannot
    # prove that the root scope is a stage pipeline, which compute_inline requires
    sch = s_tir.Schedule(func, enable_check=False)
    update = sch.get_sblock(match.block.name_hint)
    for fragment in fragments:  # the update reads shared memory directly; fragment loads replace the fills
        sch.compute_inline(sch.get_sblock(match.fills[fragment.buffer].name_hint))
    reads = [r.source for r in sch.get(update).reads]
    *around, k, rows, cols = sch.get_loops(update)
    k_tiles, k_in = sch.split(k, [None, TILE])
    row_tiles, row_in = sch.split(rows, [None, TILE])
    col_tiles, col_in = sch.split(cols, [None, TILE])
    sch.reorder(k_tiles, row_tiles, col_tiles, row_in, col_in, k_in)
    for fragment in fragments:
        shared = match.fills[fragment.buffer].reads[0].source
        load = sch.cache_read(update, next(i for i, b in enumerate(reads) if b.same_as(shared)), f"wmma.{fragment.role}")
        sch.compute_at(load, k_tiles)
        sch.tensorize(_tile(sch, load), intrinsics[f"load_{fragment.role[-1]}"])
    sch.set_scope(sch.get_sblock(match.init.name_hint), 0, "wmma.accumulator")
    sch.tensorize(row_in, intrinsics["compute"])
    sch.tensorize(_tile(sch, sch.get_sblock(match.init.name_hint)), intrinsics["init"])
    sch.tensorize(_tile(sch, sch.get_sblock(match.drain.name_hint)), intrinsics["store"])
    pipeline_fragment_loads(sch, k_tiles, around[-1] if around else None)
    return sch.mod["main"]


def pipeline_fragment_loads(sch: s_tir.Schedule, k_tiles, outer) -> None:
    """The fragment loads join the schedule's software pipeline over shared-memory tiles (`outer`,
    the loop around `k_tiles`). Inside a shared-memory tile, the next 16-wide step of k loads
    while the tensor cores work on this one (two fragment buffers);
    where the schedule pipelines its shared-memory copies over `stages` >= 3 steps, the first
    fragments of the next tile load before the last step of this one. Else every mma waits on its
    loads (measured: see docs/design.md#auto-tensorization-mmasync)."""
    if int(sch.get(k_tiles).extent) == 1:
        return  # one 16-wide step per shared-memory tile: nothing to overlap
    sch.annotate(k_tiles, "software_pipeline_stage", [0, 0, 1])  # body: load A, load B, mma
    sch.annotate(k_tiles, "software_pipeline_order", [0, 1, 2])
    stages = outer is not None and sch.get(outer).annotations.get("software_pipeline_stage")
    if not stages:
        return
    # The outer body is now: copy A, copy B, then the inner pipeline's prologue (first fragments),
    # its loop and its epilogue (last mma).
    last = int(stages[-1])
    cross = last >= 2  # a stage free between the copies and the mma: the next tile's first fragments
    for key in ("software_pipeline_stage", "software_pipeline_order"):
        sch.unannotate(outer, key)
    sch.annotate(outer, "software_pipeline_stage", [0, 0, last - cross, last, last])
    sch.annotate(outer, "software_pipeline_order", [0, 1, 3, 2, 4] if cross else [0, 1, 2, 3, 4])


def _tile(sch, block):
    """Cuts the block's two inner loops into 16 x 16 tiles; the loop over one tile's rows."""
    rows, cols = sch.get_loops(block)[-2:]
    row_tiles, row_in = sch.split(rows, [None, TILE])
    col_tiles, col_in = sch.split(cols, [None, TILE])
    sch.reorder(row_tiles, col_tiles, row_in, col_in)
    return row_in


def _unique_block_names(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every block named once: the steps find blocks by name, and a template's copies of
    two operands that share a name (two Relax values both called `lv`) are blocks of one name."""
    seen: dict = {}

    def rename(block):
        count = seen[block.name_hint] = seen.get(block.name_hint, 0) + 1
        if count == 1:
            return block
        return SBlock(block.iter_vars, block.reads, block.writes, f"{block.name_hint}_{count - 1}", block.body,
                      block.init, block.alloc_buffers, block.match_buffers, block.annotations)

    body = tvm_ffi.structural_map(func.body, (SBlock, rename))
    return func.with_body(body) if max(seen.values(), default=1) > 1 else func


def auto_tensorize(func: tirx.PrimFunc, name: str = "main") -> tirx.PrimFunc:
    """The five steps; `func` unchanged when step 1 finds no warp-level mma."""
    func = _unique_block_names(func)
    match = match_mma(func, name)
    if match is None:
        return func
    if str(match.a.source.dtype) not in TENSOR_CORE_DTYPES:
        _no_match(name, f"TVM 0.27 has no {TILE}x{TILE}x{TILE} WMMA intrinsics for {match.a.source.dtype} operands")
        return func
    return emit_wmma(scale_lane_loops(func, match), match, infer_fragments(match))


@tirx.transform.prim_func_pass(opt_level=0, name="TVMExtAutoTensorize")
def AutoTensorize(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:  # noqa: N802 (a pass, named like TVM's)
    """`auto_tensorize` on every PrimFunc of a module."""
    return auto_tensorize(func, str(func.attrs.get("global_symbol", "main")) if func.attrs else "main")
