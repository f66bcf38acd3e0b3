"""The row-chain schedule both row strategies are made of (warp_row, block_row).

`rows_per_block` rows per block on threadIdx.y, each row's reduce axis over `threads` lanes in
chunks of `vec`; reductions combine by TVM's cross-thread reduction. With `cache`, inputs read by
several blocks of the chain are staged once in shared memory."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .analysis import ReducePattern, const_int
from .device import Device
from .contracts import WIDTH_IN_VECTORS

UNROLL = 256
# Epilogues compute in float32. TVM 0.27's CUDA codegen makes an 8-lane float32 vector from lanes
# with a call nvcc rejects (tvm_ext.tir.source_hook.float8_vectors spells it out); rows kept in
# registers store their chunks whole (up to 8 halves), staged rows at most 4 lanes at a time (8:
# within 1.3% on five 16-bit rows, 3.5-4% slower on two RMSNorms, h200-2026-11-29-sweep-8-lane-epilogues.log).
MAX_EPILOGUE_LANES = 4
# Shared memory a stage leaves to what TVM's cross-thread reductions and the driver declare beside it.
STAGE_RESERVE = 4 * 1024
# Shared memory a block may use without opting in to more (CUDA's 48 KB, static and dynamic
# together; all of a static stage's), less 1 KB for what TVM's cross-thread reductions declare
# beside the stages (a few words per warp and value). TVM's runtime opts a kernel in only where
# its dynamic shared memory alone reaches 48 KB.
NO_OPT_IN_SMEM = 48 * 1024
STATIC_SMEM_LIMIT = NO_OPT_IN_SMEM - 1024


# `cache` value of the row templates: each lane's share of the rows read twice or more stays in its
# registers (no shared memory, no barrier between the reductions and the epilogue)
REGISTERS = "registers"
REGISTER_BYTES = 128  # of a lane's share of those rows at most: 32 of its 32-bit registers

HALF_TYPES = ("float16", "bfloat16")
HALF_LANES = 8  # TVM's CUDA code generator has no type for a vector of more halves ("float16x16")


def widest_lanes(pattern: ReducePattern) -> int:
    """Lanes of a 16-byte vector of the narrowest input, whatever the row's width."""
    lanes = max(1, 16 // min((pattern.dtype_bytes(b) for b in pattern.input_buffers()), default=4))
    if any(str(p.ty.dtype) in HALF_TYPES for p in pattern.sch.mod["main"].params if hasattr(p, "ty")):
        lanes = min(lanes, HALF_LANES)  # a 1-byte input (a bool mask) beside a half tensor
    return lanes


def vector_lanes(pattern: ReducePattern) -> int:
    """Widest vector (up to 16 bytes) that divides the row, so vector accesses need no tail; 1 for
    a symbolic width (its width classes choose theirs: dispatch.DYNAMIC_ROW_VARIANTS)."""
    n = const_int(pattern.reduce_extent)
    if n is None:
        return 1
    lanes = widest_lanes(pattern)
    while lanes > 1 and n % lanes:
        lanes //= 2
    return lanes


def vector_choices(pattern: ReducePattern) -> list[int]:
    """Vector widths a lane may take: the powers of two up to vector_lanes (which divides the row)."""
    widest = vector_lanes(pattern)
    return [v for v in (1, 2, 4, 8, 16) if v <= widest]


def cached_inputs(pattern: ReducePattern) -> list:
    """Inputs read by two or more blocks of the chain, laid out as [rows..., row elements...]:
    staging those saves HBM traffic. A strided row (batch statistics of NCHW over N, H, W) is
    not staged: TVM sizes such a stage by the whole tensor, which the launch refuses."""
    layout = [iv.dom.extent for iv in pattern.sch.get(pattern.reductions[0].block_rv).iter_vars]
    return [buf for buf in pattern.input_buffers()
            if [const_int(d) for d in buf.shape] == [const_int(e) for e in layout] and passes_over(pattern, buf) > 1]


def passes_over(pattern: ReducePattern, buf) -> int:
    """Blocks of the chain that read `buf` (the pivot aside)."""
    sch = pattern.sch
    return sum(any(r.source.same_as(buf) for r in sch.get(b.block_rv).reads) for b in pattern.blocks)


def row_bytes(pattern: ReducePattern, buffers, width: int | None = None) -> int | None:
    """Bytes of a row of `buffers`; a symbolic width counts as `width` (its class's bound) where given."""
    n = const_int(pattern.reduce_extent) or width
    return None if n is None else sum(n * pattern.dtype_bytes(buf) for buf in buffers)


def estimated_registers(pattern: ReducePattern) -> int:
    """Registers per thread of a row kernel, before it is compiled: ncu on sm_90 read 32 for
    softmax, RMSNorm and batch statistics, 40 for LayerNorm, whose epilogue reads five values
    (x, mean, rstd, weight, bias) per element."""
    if pattern.epilogue is None:
        return 32
    reads = pattern.sch.get(pattern.epilogue.block_rv).reads
    return 32 if len(reads) <= 3 else 40


def normalises(pattern: ReducePattern) -> bool:
    """Whether the chain is a normalisation by a row's mean and variance: a reduction of a state of
    several values (Welford's), or an epilogue of five reads or more (LayerNorm spelled out: x, the
    two sums, weight, bias; softmax reads three, four with a mask, RMSNorm three)."""
    if let_bound(pattern):
        return True
    return pattern.epilogue is not None and len(pattern.sch.get(pattern.epilogue.block_rv).reads) >= 5


def _row_dims(pattern: ReducePattern) -> list:
    return [const_int(d) for d in pattern.reductions[0].dom()[:pattern.num_spatial]]


def rows_cross(pattern: ReducePattern, rows_per_block: int) -> bool:
    """Whether a block of `rows_per_block` rows fused over the row dims could cross from one index
    of an outer row dim to the next where TVM cannot bound the block's rows: the innermost row dim
    is symbolic ([2, seq] of a batch), or the rows do not divide it under a symbolic dim ([batch,
    17] tokens) or two more dims ([2, 4, 100] heads of 100 queries). TVM then bounded a block's
    rows by every row of the tensor and compute_at raised; schedule_rows splits the innermost row
    dim alone instead. Over two static dims TVM bounds them exactly."""
    dims = _row_dims(pattern)
    if rows_per_block == 1 or len(dims) < 2 or dims[-1] is not None and dims[-1] % rows_per_block == 0:
        return False
    return len(dims) > 2 or None in dims


def rows_dividing(pattern: ReducePattern, rows_per_block: int) -> int:
    """The most rows a block, up to `rows_per_block`, that never cross a row dim over static dims
    (rows_cross's blocks leave the last block of each outer index part idle); over symbolic dims
    the rows stay (a block of one row would be one lane group)."""
    if None in _row_dims(pattern):
        return rows_per_block
    while rows_cross(pattern, rows_per_block):
        rows_per_block //= 2
    return rows_per_block


def stage_is_bounded(pattern: ReducePattern, rows_per_block: int) -> bool:
    """Whether TVM can size a shared-memory stage of `rows_per_block` rows by the block's rows: with a
    symbolic row count and several rows per block it sizes it by the whole tensor instead, and the
    launch fails for large enough n; with rows spread over several non-unit dims (attention scores,
    8 x 12 x 128 rows) it bounds each dim separately, with extents that are not constant, and the
    stage cannot be bound to threads."""
    if rows_per_block == 1:
        return True
    sch = pattern.sch
    row_dims = [const_int(sch.get(loop).extent) for loop in sch.get_loops(pattern.blocks[-1].block_rv)[:pattern.num_spatial]]
    return const_int(pattern.row_count) is not None and sum(d != 1 for d in row_dims) <= 1


def stage_limit(device: Device) -> int:
    """The largest stage of rows a block takes: all the shared memory a block may opt in to. A row
    the chain reads twice or more is read from HBM once, even at one block an SM (a row of 100 KB
    (softmax over GPT-2's 50257 fp16 logits) or 128 KB: re-read, each pass costs as much as the
    whole staged kernel's reads; docs/design.md#row-and-column-templates)."""
    return device.smem_opt_in - STAGE_RESERVE


def worth_caching(pattern: ReducePattern, device: Device, rows_per_block: int = 1) -> bool:
    size = row_bytes(pattern, cached_inputs(pattern))
    return bool(size) and size * rows_per_block <= stage_limit(device) and stage_is_bounded(pattern, rows_per_block)


def fits_registers(pattern: ReducePattern, lanes: int, max_extent: int | None = None) -> bool:
    """Whether a lane's share of the inputs read twice or more (over `lanes` lanes a row) fits
    REGISTER_BYTES, so that the chain can keep them in registers (cache=REGISTERS). A symbolic
    width is counted at its class's `max_extent`, and needs an epilogue (schedule_rows)."""
    if const_int(pattern.reduce_extent) is None and pattern.epilogue is None:
        return False
    size = row_bytes(pattern, cached_inputs(pattern), max_extent)
    return bool(size) and size <= lanes * REGISTER_BYTES


def cache_choices(pattern: ReducePattern, lanes: int, shared_fits: bool) -> list:
    """The `cache` values of a point with `lanes` lanes a row: not staged, staged in shared memory
    where `shared_fits`, kept in registers where a lane's share fits them."""
    return [False] + [True] * shared_fits + [REGISTERS] * fits_registers(pattern, lanes)


def register_vector(pattern: ReducePattern, vec: int) -> int:
    """The vector the heuristic gives a lane for rows kept in registers: at most MAX_EPILOGUE_LANES
    where there is an epilogue. Measured while the epilogue stored a chunk of 8 halves 4 lanes at a
    time (each store then covered half of every 16 bytes across a warp): LayerNorm 32768 x 768 f16
    in registers at 8 lanes 33.1 us, at 4 lanes 32.4; 49152 x 1024 58.0 against 53.5
    (h200-2026-11-29-sweep-register-rows.log); with whole 8-lane stores, LayerNorm and softmax 49152 x
    1024 f16 are within 1% of 4 lanes
    (h200-2026-11-29-sweep-8-lane-epilogues.log)."""
    return min(vec, MAX_EPILOGUE_LANES) if pattern.epilogue is not None else vec


def let_bound(pattern: ReducePattern) -> bool:
    """Whether a reduction of the chain updates a state of several values through let-bindings
    (Welford's (M2, mean, count), the one-pass (sum, sum of squares))."""
    found = []
    for info in pattern.reductions:
        tvm_ffi.structural_walk(pattern.sch.get(info.block_rv).body, (tirx.Bind, found.append), order="pre")
    return bool(found)


def stage_scopes(pattern: ReducePattern, buffers: list, rows_per_block: int) -> list[tuple]:
    """(buffer, storage scope) of each input to stage: dynamic shared memory (TVM's runtime raises
    the 48 KB default when a launch asks for more), but at most one dynamic stage where a
    reduction's update is let-bound.

    TVM 0.27's MergeSharedMemoryAllocations, which runs once a kernel has two dynamic allocations,
    rejects a let-binding that loads any buffer of the kernel outside a loop or branch ("Load
    memory in places other than store"), and that is where Welford's update lands once each lane
    takes its share of the row in one unrolled chunk: residual + LayerNorm, which stages x and the
    residual, failed at every BERT width. The largest stage then stays dynamic and the others are
    static while they fit: 48 KB in all, or 48 KB of static stages beside a dynamic one of 48 KB or
    more (a launch is only opted in to more for the latter); any left over is read from global
    memory (at 8192 float32 columns, one row a block, the residual)."""
    if len(buffers) < 2 or not let_bound(pattern):
        return [(buf, "shared.dyn") for buf in buffers]
    sizes = [(row_bytes(pattern, [buf]) or 0) * rows_per_block for buf in buffers]
    largest = sizes.index(max(sizes))
    budget = STATIC_SMEM_LIMIT - (sizes[largest] if sizes[largest] < NO_OPT_IN_SMEM else 0)
    scopes = []
    for i, buf in enumerate(buffers):
        if i == largest:
            scopes.append((buf, "shared.dyn"))
        elif sizes[i] <= budget:
            budget -= sizes[i]
            scopes.append((buf, "shared"))
    return scopes


def _spread(sch: s_tir.Schedule, loops, threads: int, vec: int, vectorize: bool, steps: int | None = None):
    """Fuse `loops` and spread them over threadIdx.x in chunks of `vec` adjacent elements.

    Stores and copies vectorize the chunk; a reduction unrolls it. Returns the serial loop. A
    symbolic extent is split into chunks without a predicate: the kernel serves only widths that
    are a multiple of `vec` (its width class's condition), so no chunk is partial. `steps`: the
    serial loop's extent (each step tested against the width), so that a symbolic width bounded
    by its class unrolls into the steps a lane's registers hold.
    """
    fused = sch.fuse(*loops)
    if vec > 1 and const_int(sch.get(fused).extent) is None:
        rest, lane = sch.split(fused, [None, vec], disable_predication=True)
        outer, tx = sch.split(rest, [steps, threads])
    else:
        outer, tx, lane = sch.split(fused, [steps, threads, vec])
    sch.reorder(tx, outer, lane)
    sch.bind(tx, "threadIdx.x")
    if vec > 1:
        (sch.vectorize if vectorize else sch.unroll)(lane)
    sch.annotate(outer, "pragma_auto_unroll_max_step", UNROLL)
    sch.annotate(outer, "pragma_unroll_explicit", 1)
    return outer


def _wide_reads(sch: s_tir.Schedule, reduction, outer, buffers) -> None:
    """Give a reduction its chunk of each of `buffers` through registers, loaded as vectors of up
    to 16 bytes.

    Read element by element, a thread's 16-byte chunk of a staged row costs 8 shared-memory loads
    that conflict 4 ways (the threads' chunks are 16 bytes apart); one `ld.shared.v4` instead. From
    global memory, each element load of a warp touches 32 sectors 16-32 bytes apart, so the chunk
    is fetched 8-16 times through L1.
    """
    for buf in buffers:
        reads = sch.get(reduction).reads
        index = next((i for i, r in enumerate(reads) if r.source.same_as(buf)), None)
        # one element per block instance only: a reduction that also reads elsewhere in the row
        # (Welford's pivot, the row's first element) would copy the whole row into registers
        if index is not None and reads[index].region and all(const_int(r.extent) == 1 for r in reads[index].region):
            regs = sch.cache_read(reduction, index, "local", consumer_blocks=[reduction])
            sch.compute_at(regs, outer, preserve_unit_loops=True)
            chunk = sch.get_loops(regs)[-1]
            lanes = max(1, 16 * 8 // tvm.DataType(str(buf.dtype)).bits)
            if const_int(sch.get(chunk).extent) > lanes:
                chunk = sch.split(chunk, [None, lanes])[1]
            sch.vectorize(chunk)


def unaligned_vectors(pattern: ReducePattern, knobs: dict) -> bool:
    """Whether `knobs` take vectors over a symbolic width without a width class's promise that
    the vector divides it (`max_extent`, set by dispatch.width_classes with that condition)."""
    vectors = max(int(knobs.get("vec", 1)), int(knobs.get("reduce_vec") or 1)) > 1
    return vectors and const_int(pattern.reduce_extent) is None and "max_extent" not in knobs


def schedule_rows(pattern: ReducePattern, threads: int, rows_per_block: int, vec: int, cache: bool | str,
                  reduce_vec: int | None = None, max_extent: int | None = None):
    """The chain of `pattern` with rows along blockIdx.x/threadIdx.y, lanes along threadIdx.x.

    `cache`: True stages the inputs read twice or more in shared memory; REGISTERS keeps each
    lane's share of them in its registers, every block of the chain taking the same chunks.
    `reduce_vec`: adjacent elements a lane takes per step in the reductions (default `vec`; also
    for rows read from global memory, where wider steps beat 1 on batch statistics; measured: see
    docs/design.md#row-and-column-templates). `max_extent`: the largest width a symbolic width's
    class serves; rows kept in registers then take that width's steps, each tested.
    """
    registers = cache == REGISTERS
    reduce_vec = vec if registers else reduce_vec or vec
    width = const_int(pattern.reduce_extent)
    steps = None
    if registers and width is None:
        # a lane's registers need a bound TVM can prove (dispatch.in_vectors spells it in), and an
        # epilogue that takes the stage's chunks
        if max_extent is None or pattern.epilogue is None or not _bounded(pattern.reduce_extent, max_extent):
            return None
        steps = -(-int(max_extent) // (threads * vec))
    elif cache and not stage_is_bounded(pattern, rows_per_block):
        return None
    pattern = pattern.with_pivots_apart()  # the reductions then read one element of the row each
    sch, ns = pattern.sch, pattern.num_spatial
    last = pattern.blocks[-1]
    outputs = [info.block_rv for info in pattern.row_outputs] + [last.block_rv]
    if not pattern.merge_outputs():
        return None
    loops = sch.get_loops(last.block_rv)
    if rows_cross(pattern, rows_per_block):  # the innermost row dim split alone: a block's rows never cross
        inner_blocks, row = sch.split(loops[ns - 1], [None, rows_per_block])
        block = sch.fuse(*loops[:ns - 1], inner_blocks)
    else:
        block, row = sch.split(sch.fuse(*loops[:ns]), [None, rows_per_block])
    sch.bind(block, "blockIdx.x")
    sch.bind(row, "threadIdx.y")
    in_vectors = WIDTH_IN_VECTORS in (sch.mod["main"].attrs or {})
    wide = reduce_vec > 1 and (in_vectors or (width is not None and width % (threads * reduce_vec) == 0))
    reductions = []
    if len(loops) > ns and pattern.epilogue is not None:  # an epilogue over every element of the row
        # rows in registers: the stage's own chunks
        _spread(sch, loops[ns:], threads, vec if registers else min(vec, MAX_EPILOGUE_LANES), vectorize=True,
                steps=steps)
    elif len(loops) > ns:  # the row's last reduction: chunks where they are read as vectors (below)
        chunks = reduce_vec if wide and not (in_vectors and cache) else 1
        reductions.append((last.block_rv, _spread(sch, loops[ns:], threads, chunks, vectorize=False)))
    else:  # one value per row (per output): lane 0 writes it
        for output in outputs:
            _spread(sch, [sch.add_unit_loop(output)], threads, 1, vectorize=True)

    for info in reversed(pattern.row_reductions):
        for i, _ in enumerate(sch.get(info.block_rv).writes):
            sch.set_scope(info.block_rv, i, "local" if rows_per_block > 1 else "shared")
        sch.compute_at(info.block_rv, row, preserve_unit_loops=True)
        outer = _spread(sch, sch.get_loops(info.block_rv)[2:], threads, reduce_vec, vectorize=False, steps=steps)
        reductions.append((info.block_rv, outer))
    for pivot in pattern.prologue:  # every thread loads its row's pivot into a register
        sch.set_scope(pivot.block_rv, 0, "local")
        sch.compute_at(pivot.block_rv, row, preserve_unit_loops=True)

    staged_buffers = []
    if registers:
        stages = [(buf, "local") for buf in cached_inputs(pattern)]
    else:
        stages = stage_scopes(pattern, cached_inputs(pattern), rows_per_block) if cache else []
    for buf, scope in stages:
        # a pivot reads another lane's element: it keeps reading memory beside a register stage
        consumers = [b.block_rv for b in (pattern.blocks if registers else pattern.prologue + pattern.blocks)
                     if any(r.source.same_as(buf) for r in sch.get(b.block_rv).reads)]
        index = [i for i, r in enumerate(sch.get(consumers[0]).reads) if r.source.same_as(buf)][0]
        stage = sch.cache_read(consumers[0], index, scope, consumer_blocks=consumers)
        sch.compute_at(stage, block, preserve_unit_loops=True)  # each threadIdx.y stages its own row
        staged_row, *columns = sch.get_loops(stage)[1:]
        sch.bind(sch.fuse(staged_row, *columns[:-1]) if len(columns) > 1 else staged_row, "threadIdx.y")
        _spread(sch, columns[-1:], threads, vec, vectorize=True, steps=steps)
        if registers:
            # [chunk, element]: a lane's own chunks (a local buffer is the lane's own; each block of
            # the chain binds threadIdx apart, so TVM cannot bound a lane's part of the row itself)
            sch.transform_layout(stage, ("write", 0), lambda *i: (i[-1] // (threads * vec), i[-1] % vec),
                                 assume_injective_transform=True)
        staged_buffers.append(sch.get(stage).writes[0].source)
    # inputs a reduction may copy to registers from memory; bool aside: TVM 0.27 has no CUDA type
    # for a register vector of bools
    from_memory = [buf for buf in pattern.input_buffers() if str(buf.dtype) != "bool"
                   and not any(buf.same_as(s) for s in staged_buffers)]
    if reduce_vec > 1 and in_vectors and not staged_buffers:
        # a width class of whole vectors (dispatch.in_vectors), read from memory: one vector load a
        # chunk, where element loads are eight a chunk, 16 bytes apart across lanes (measured:
        # docs/design.md#row-and-column-templates)
        for reduction, outer in reductions:
            _wide_reads(sch, reduction, outer, from_memory)
    elif wide and width is not None:
        # only without a tail chunk: under the tail's predicate TVM puts the barrier that guards
        # the register copy inside `if (threadIdx.x < ...)`, and the block deadlocks (e.g.
        # log_softmax over 3000 columns)
        # From memory only when a lane's chunk is its whole share of the row: with several chunks
        # per lane the register copies cost more than they save (measured on LLaMA's attention
        # softmax: docs/design.md#row-and-column-templates); a reduction that ends the chain (a row
        # sum) reads every chunk as a vector, as its reads are the kernel's only traffic.
        one_chunk = width == threads * reduce_vec
        in_shared = [] if registers else staged_buffers
        for reduction, outer in reductions:
            ends = reduction.same_as(last.block_rv)
            _wide_reads(sch, reduction, outer, in_shared + (from_memory if one_chunk or ends else []))
    return _bounded_registers(sch, staged_buffers, steps, vec) if steps else sch


def _bounded(extent, bound: int) -> bool:
    """Whether TVM can prove `extent` at most `bound` (its split of a lane's steps must)."""
    return tvm.sym.Analyzer().can_prove(extent <= bound)


def _bounded_registers(sch: s_tir.Schedule, stages: list, steps: int, vec: int) -> s_tir.Schedule:
    """`sch`'s function with each register stage of a symbolic width sized [steps, vec], its class's
    bound (a lane's chunks of the widest row it serves): TVM sizes it by the symbolic width, and
    CUDA has no local array of a size known only at launch."""
    bounded = [(buf, tirx.decl_buffer((steps, vec), buf.dtype, buf.name, scope="local")) for buf in stages]

    def resize(var):
        return next((new for old, new in bounded if var.same_as(old)), var)
    return s_tir.Schedule(tvm_ffi.structural_map(sch.mod["main"], (tvm.ir.Var, resize)))
