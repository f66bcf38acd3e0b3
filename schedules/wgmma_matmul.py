"""Warpgroup matmul (Hopper `wgmma`): the fp16 matmul template for sm_90a targets.

`mma.sync` (matmul.py) stops near half of cuBLAS on Hopper; wgmma reads operands from shared
memory. TVM schedules do not reach it, so this template writes the kernel with TVM's PTX
intrinsics. Limits: fp16, static sizes, N and K multiples of 64, A read along k; anything else goes
to the thread-level template. See docs/design.md#warpgroup-matmuls-wgmma."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27
from tvm.script import tirx as T

from . import matmul
from .contracts import GATE_RUN, WGMMA_TYPES, WIDE_TILE, WIDE_TILE_WAVES, gate_column
from .analysis import const_int, multiply_accumulate, size_of, substitute

NAME = "wgmma_matmul"
ROWS = 64  # of one warpgroup's m64nNk16
K_TILE = 64  # k per stage: one 128-byte swizzled row of 2-byte operands
WARPGROUP = 128
SWIZZLE_128B = 3  # the descriptor helper's code for 128-byte swizzling
ATOM_BYTES = 1024  # 8 rows of 128 bytes: the swizzle pattern repeats at this stride
OUTPUT_PAD = 8  # fp16 elements after each staged output row: the 8 rows a warp writes at once start in different banks
TILES = [(128, 256), (128, 224), (128, 192), (128, 128), (64, 256), (64, 128), (64, 64)]  # (block_m, block_n), largest first
WIDE = (256, 224, 192)  # widths of a 128-row tile alone on its SM, among which the heuristic fills the last wave
MOST_WASTED = 0.1  # of C's columns a row of tiles may pass its edge by (a partial last tile)
TMA_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B: the same layout the descriptors' 128-byte mode reads
BARRIER_BYTES = 16  # per stage with TMA: its "full" and "empty" mbarriers
PRODUCER_THREADS = 32  # the warp issuing TMA loads
TMA_MIN_STAGES = 4
TWO_PER_SM = matmul.MAX_SHARED // 2 - 1024  # shared bytes a block may take and share its SM (the driver keeps 1 KB per block)


def swizzled(row, col, rows: int):
    """Offset of fp16 element (row, col) in a shared tile of `rows` rows kept as 64-column chunks of
    128-byte rows, swizzled as the descriptors' 128-byte mode reads them: the k-major layout (rows
    of 64 k) and, for an n-major B, its 64-column atoms."""
    return col // 64 * (rows * 64) + row * 64 + T.bitwise_xor(col % 64 // 8, row % 8) * 8 + col % 8


def accumulator_position(tx, r):
    """(row, column) in a warpgroup-row tile of accumulator register r of thread tx: the m64nNk16
    layout (each warp 16 rows; a lane 4 registers per 8 columns)."""
    return tx // 32 * 16 + tx % 32 // 4 + 8 * (r // 2 % 2), r // 4 * 8 + tx % 4 * 2 + r % 2


def float32_contraction(func: tirx.PrimFunc):
    """(Schedule, matmul block, its epilogue blocks, operand dtype, the block's extents) of a matmul
    of fp16 or bf16 operands into float32 whose sizes are static but the rows, else None: what this
    template and the few-row one (few_row_matmul.py) start from."""
    found = matmul.contraction(func, over_c=False)
    if found is None:
        return None
    sch, block_rv, epilogue = found
    block = sch.get(block_rv)
    a, _ = multiply_accumulate(block.body)
    extents = [iv.dom.extent for iv in block.iter_vars]
    if str(a.source.dtype) not in WGMMA_TYPES or str(block.writes[0].source.dtype) != "float32" \
            or not matmul.static_but_rows(extents):
        return None
    return sch, block, epilogue, str(a.source.dtype), extents


def _fit(func: tirx.PrimFunc):
    """(matmul block, its epilogue folded as `fold_epilogue` gives it) of a matmul this template
    takes, else None."""
    found = float32_contraction(func)
    if found is None or matmul.part_strides(found[1]) != []:
        return None
    sch, block, epilogue, operand, extents = found
    m, n, k = (const_int(e) for e in extents[-3:])
    if m is not None and m < ROWS or n % 64 or k % K_TILE or not matmul.k_is_last(block)[0]:
        return None
    folded = fold_epilogue(sch, epilogue, block.writes[0].source, extents[:-1])
    if folded is None or folded.gated and str(folded.out.dtype) != operand:  # gated: staged in shared memory
        return None
    return block, folded


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """Every tile that divides the matmul, each with as many stages as shared memory holds (up to
    8) and with as many as leave room for a second block on the SM; those of TMA_MIN_STAGES or more
    also loaded by TMA where the operands allow it."""
    return _points(_fit(func))


def _points(found) -> list[dict]:
    """knob_space of a matmul `_fit` took (none for None)."""
    if found is None:
        return []
    *_, m, n, _ = _sizes(found)
    b_n_major = not matmul.k_is_last(found[0])[1]
    points = [{"strategy": NAME, "block_m": bm, "block_n": bn, "stages": stages, "group": _group(m, bm)}
              for bm, bn in TILES if (not isinstance(m, int) or bm <= m) and _width_fits(bn, n, b_n_major) for stages in _stage_counts(bm, bn)]
    copied = [p for p in points if not _wrong_when_copied(p["block_m"], p["block_n"], p["stages"])]
    if _tma_views(found[0]) is None:  # operands a descriptor cannot describe
        return copied
    return copied + [{**p, "tma": 1} for p in points if _tma_fits(p["block_m"], p["block_n"], p["stages"])]


def _wrong_when_copied(block_m: int, block_n: int, stages: int) -> bool:
    """Points that store wrong sums when loaded by cp.async: a 64 x 64 tile with a wgmma group in
    flight (8 stages) got about 1 in 2000 outputs wrong by more than 0.05 with its output staged
    through shared memory after 64 steps of k (H200; the same point loaded by TMA, 7 stages, 64 x 128
    tiles of 8 stages and an unstaged float32 output are right; the cause is not found).
    tests/test_wgmma.py runs every point of the space over such a k."""
    return (block_m, block_n) == (ROWS, 64) and _in_flight(block_m, block_n, stages) > 0


def _tma_fits(block_m: int, block_n: int, stages: int) -> bool:
    """Whether TMA may load these stages: enough of them for the loads to run ahead (with two, TMA
    is slower than cp.async: docs/design.md#warpgroup-matmuls-wgmma) and room for their barriers."""
    return stages >= TMA_MIN_STAGES and stages * (stage_bytes(block_m, block_n) + BARRIER_BYTES) <= matmul.MAX_SHARED


def block_threads(block_m: int, tma: bool) -> int:
    """Threads of a block: a warpgroup per 64 rows, and with TMA the producer warp."""
    return block_m // ROWS * WARPGROUP + tma * PRODUCER_THREADS


def _width_fits(bn: int, n: int, b_n_major: bool) -> bool:
    """Whether tiles `bn` wide cover N columns without passing C's edge by more than MOST_WASTED of
    them; an n-major B comes in 64-column atoms, so its tiles are whole atoms."""
    return (bn % 64 == 0 or not b_n_major) and _tiles(n, bn) * bn - n <= MOST_WASTED * n


def _tiles(size, tile: int):
    """Tiles covering `size` (an int, or a PrimExpr for a symbolic row count)."""
    return (size + tile - 1) // tile


def block_count(batch: int, m: int, n: int, block_m: int, block_n: int) -> int:
    """Blocks of a launch: one per tile of C (the last row and column of tiles may pass its edge)."""
    return batch * _tiles(m, block_m) * _tiles(n, block_n)


def _group(m, block_m: int) -> int:
    """Rows of tiles consecutive blocks walk down before the next column: 8 (or 4) where they
    divide the rows, so B's columns stay in L2 (measured: see docs/design.md#warpgroup-matmuls-wgmma);
    8 over a symbolic row count, whose last group may be short."""
    return next((g for g in (8, 4) if _tiles(m, block_m) % g == 0), 0) if isinstance(m, int) else 8


def _stage_counts(block_m: int, block_n: int) -> list[int]:
    """The most stages one block may have (at most 8), then the most that let two blocks share an
    SM; counts too small to pipeline (one tile ahead of the one
    read, and of the one in flight, see `_in_flight`) or to hold the output tile (staged through the
    same memory) dropped."""
    stage = stage_bytes(block_m, block_n)
    counts = [min(8, matmul.MAX_SHARED // stage), TWO_PER_SM // stage]
    return sorted({c for c in counts if c >= 2 + _in_flight(block_m, block_n, c)
                   and c * stage >= _output_bytes(block_m, block_n)}, reverse=True)


def _in_flight(block_m: int, block_n: int, stages: int) -> int:
    """1 where a block is alone on its SM: its tensor cores then keep one wgmma group in flight
    while it issues the next; with two blocks per SM the other block fills the wait, and a stage
    more of copies ahead is faster (measured: see docs/design.md#warpgroup-matmuls-wgmma)."""
    return int(stages * stage_bytes(block_m, block_n) > TWO_PER_SM)


def _output_bytes(block_m: int, block_n: int) -> int:
    """Shared memory of the staged fp16 output tile."""
    return block_m * (block_n + OUTPUT_PAD) * 2


def _sizes(found) -> list:
    """The matmul block's extents: batch..., m, n, k (ints; m a PrimExpr where symbolic)."""
    return [size_of(iv.dom.extent) for iv in found[0].iter_vars]


def stage_bytes(block_m: int, block_n: int) -> int:
    """Shared memory of one stage: A's and B's 64-k fp16 tiles."""
    return (block_m + block_n) * K_TILE * 2


# (tile, waves of blocks it must give, stage count, least K), first fit wins. 128 x 256 tiles alone
# on an SM (a wgmma group in flight) where they give about two waves: the largest tile reuses its
# operands most, and one wave would leave the last one idle. Else 64 x 256 tiles with 5 stages over
# a long K (K >= 3072) where 128 x 256 gives under a wave: the smaller tile fills the SMs, and a
# long K amortises its pipeline fill; over a short K they lose to two blocks per SM. Else two
# blocks per SM, which hide each other's waits and beat one block with more stages on model shapes.
# Measured: see docs/design.md#warpgroup-matmuls-wgmma.
PREFERENCE = [(WIDE_TILE, WIDE_TILE_WAVES, "most", 0), ((64, 256), 0.9, "most", 3072), ((128, 128), 1, "two per SM", 0),
              ((64, 128), 1, "two per SM", 0)]


def heuristic(func: tirx.PrimFunc, sm_count: int, rows: int | None = None) -> tuple[dict, s_tir.Schedule] | None:
    """The first tile of PREFERENCE that fits and gives enough blocks, with its stage count (loaded by
    TMA where it may be alone on its SM), else the fitting tile giving the most blocks, two per SM.
    A symbolic row count is planned for as `rows` rows."""
    found = _fit(func)
    space = _points(found)
    if not space:
        return None
    *batch, m, n, k = _sizes(found)
    if not isinstance(m, int):
        if rows is None:
            return None
        m = rows
    by_tile: dict = {}
    for knobs in space:  # each tile's points: most stages first, then those loaded by TMA
        by_tile.setdefault((knobs["block_m"], knobs["block_n"]), []).append(knobs)
    blocks = {(bm, bn): block_count(math.prod(batch), m, n, bm, bn) for bm, bn in by_tile}
    tile, stages = next(((tile, stages) for tile, waves, stages, least_k in PREFERENCE
                         if tile in by_tile and blocks[tile] >= waves * sm_count and k >= least_k),
                        (max(blocks, key=blocks.get), "two per SM"))
    if stages == "most":
        tile = _fullest_waves(tile, [t for t in by_tile if t[0] == tile[0] and t[1] in WIDE], blocks, sm_count)
    copied = [p for p in by_tile[tile] if not p.get("tma")]
    knobs = copied[0 if stages == "most" else -1]
    knobs = next((p for p in by_tile[tile] if stages == "most" and p.get("tma") and p["stages"] == knobs["stages"]), knobs)
    return knobs, _apply(func, found, knobs)


def _fullest_waves(tile, tiles: list, blocks: dict, sm_count: int):
    """The tile of `tiles` (one block per SM) whose waves of blocks span the fewest columns, where
    that is at least 5% fewer than `tile`'s: the last wave of wider tiles may be half empty."""
    def span(t):
        return _tiles(blocks[t], sm_count) * t[1]

    best = min(tiles, key=span, default=tile)
    return best if span(best) <= 0.95 * span(tile) else tile


def _tensor_view(load, block, inner, outer):
    """How a TMA descriptor sees `load`'s buffer: (dims inner first, byte strides, coordinate of the
    batch axes as a function of their iterators' values) with the buffer's last two axes indexed by
    `inner` and `outer` iterators and any axes before them by distinct batch iterators (collapsed
    into one axis); None for any other indexing. A symbolic row count stays a dim of the
    descriptor, encoded at run time."""
    ivs = [iv.var for iv in block.iter_vars]
    batch_vars = ivs[:-3]
    shape, indices = [const_int(x) for x in load.source.shape], list(load.indices)
    *lead, second, last = indices
    if not (last.same_as(inner) and second.same_as(outer)) \
            or not all(any(i.same_as(v) for v in batch_vars) for i in lead) or len(set(map(str, lead))) != len(lead) \
            or None in shape[:-2] + shape[-1:] or shape[-2] is None and lead:
        return None
    shape[-2] = load.source.shape[-2] if shape[-2] is None else shape[-2]
    itemsize = 2  # fp16: the only operands _fit takes
    dims = [shape[-1], shape[-2]] + ([math.prod(shape[:-2])] if lead else [])
    strides = [shape[-1] * itemsize] + ([shape[-1] * shape[-2] * itemsize] if lead else [])

    def batch_coordinate(values: dict):
        coordinate = 0
        for index, extent in zip(lead, shape[:len(lead)]):
            coordinate = coordinate * extent + next(x for v, x in values.items() if v.same_as(index))
        return [coordinate] if lead else []

    return dims, strides, batch_coordinate


@dataclass(frozen=True)
class Epilogue:
    """The elementwise work after the matmul folded into one `value` stored to `out` at its block's
    iterators `ivs` (None: C itself is the output), with Vars `loads` standing for the
    accumulator's loads in it: (acc,) for work over C's own positions, (gate, up) for a gated
    output half C's width, whose column j reads C's columns gate_column(j, 0) and (j, 1)."""

    out: tirx.Buffer
    ivs: list | None
    value: tirx.PrimExpr
    loads: tuple

    @property
    def gated(self) -> bool:
        return len(self.loads) == 2


def fold_epilogue(sch, epilogue: list, accumulator: tirx.Buffer, extents: list) -> Epilogue | None:
    """The elementwise blocks after the matmul (C's `extents`) as one Epilogue; None when the
    last does not read the accumulator as either kind of Epilogue does, or one before it does not
    inline into it."""
    if not epilogue:
        acc = tirx.Var("acc", "float32")
        return Epilogue(accumulator, None, acc, (acc,))
    try:
        for consumer in epilogue[:-1]:
            sch.compute_inline(consumer)
    except s_tir.ScheduleError:
        return None
    block = sch.get(epilogue[-1])
    store, ivs = block.body, [iv.var for iv in block.iter_vars]
    if len(store.indices) != len(ivs) or any(not i.same_as(v) for i, v in zip(store.indices, ivs)):
        return None
    if matmul.same_extents(block.iter_vars, extents):
        loads, positions = (tirx.Var("acc", "float32"),), [ivs]
    elif int(extents[-1]) % (2 * GATE_RUN) == 0 and matmul.same_extents(block.iter_vars, [*extents[:-1], extents[-1] // 2]):
        loads = (tirx.Var("gate", "float32"), tirx.Var("up", "float32"))
        positions = [[*ivs[:-1], gate_column(ivs[-1], half)] for half in (0, 1)]
    else:
        return None
    analyzer = tvm.sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    found, elsewhere = set(), []

    def replace(load):
        if not load.source.same_as(accumulator):
            return load
        for var, position in zip(loads, positions):
            if len(load.indices) == len(position) and all(analyzer.can_prove_equal(i, p) for i, p in zip(load.indices, position)):
                found.add(var)
                return var
        elsewhere.append(load)
        return load

    value = tvm_ffi.structural_map(store.value, (TensorLoad, replace))
    gated_half_unread = len(loads) == 2 and len(found) < 2
    return None if elsewhere or gated_half_unread else Epilogue(store.buffer, ivs, value, loads)


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    """The wgmma kernel for `func` with `knobs` (block_m, block_n, stages), as a Schedule of the
    finished loop nest (nothing is left to schedule); None when it does not fit."""
    return _apply(func, _fit(func), knobs)


def _apply(func: tirx.PrimFunc, found, knobs: dict) -> s_tir.Schedule | None:
    """apply, on what `_fit` found in `func`."""
    if found is None:
        return None
    block, folded = found
    bm, bn, stages, group, tma = (int(knobs.get(x, 0)) for x in ("block_m", "block_n", "stages", "group", "tma"))
    *batch, m, n, k = _sizes(found)
    views = _tma_views(block) if tma else None
    if bm % ROWS or bn % 32 or bn > 256 or isinstance(m, int) and bm > m or not _width_fits(bn, n, not matmul.k_is_last(block)[1]) \
            or stages < 2 + _in_flight(bm, bn, stages) or group and isinstance(m, int) and _tiles(m, bm) % group \
            or not _output_bytes(bm, bn) <= stages * stage_bytes(bm, bn) <= matmul.MAX_SHARED \
            or tma and (views is None or not _tma_fits(bm, bn, stages)) or not tma and _wrong_when_copied(bm, bn, stages):
        return None
    return s_tir.Schedule(func.with_body(_kernel(block, folded, bm, bn, stages, group, views, batch, m, n, k)))


def _kernel(block, folded, bm, bn, stages, group, views, batch, m, n, k) -> tirx.Stmt:
    """The loop nest, written against the original function's buffers; with `views` (_tma_views),
    loaded by TMA, after the host statements that encode its descriptors."""
    a_load, b_load = multiply_accumulate(block.body)
    ivs = [iv.var for iv in block.iter_vars]
    *batch_vars, row_var, col_var, k_var = ivs
    b_n_major = not matmul.k_is_last(block)[1]
    ep, out = folded, folded.out
    tma = views is not None
    consumers, threads = block_threads(bm, False), block_threads(bm, tma)
    a_elems, b_elems = bm * K_TILE, bn * K_TILE
    stage_elems = a_elems + b_elems
    a_chunks, b_chunks = a_elems // 8 // consumers, b_elems // 8 // consumers  # 16-byte copies per thread
    in_flight = _in_flight(bm, bn, stages)
    k_tiles, ahead = k // K_TILE, min(stages - 1 - in_flight, k // K_TILE)  # in flight: stage kt - 1 may still be read
    regs = bn // 2
    columns, partial = _tiles(n, bn), n % bn != 0
    rows, partial_rows = _tiles(m, bm), not isinstance(m, int) or m % bm != 0
    rows = rows if isinstance(rows, int) else T.Cast("int32", rows)  # a tile count: int32 in a 64-bit build too

    def within(index, last):
        """`index`, held at `last` where the last column of tiles passes C's edge."""
        return T.min(index, last) if partial else index

    def within_rows(row):
        """`row`, held at C's last where the last row of tiles passes C's edge."""
        return T.min(row, m - 1) if partial_rows else row

    def inside(column, edge, row=None):
        """Whether `column` is before the output's `edge` and `row` before C's last row (always, unless the
        last column or row of tiles passes C's edge)."""
        tests = ([column < edge] if partial else []) + ([row < m] if partial_rows and row is not None else [])
        return functools.reduce(tirx.And, tests) if tests else T.bool(True)

    def at(load, bindings):
        """The element of `load`'s buffer at the matmul's iterators bound to `bindings`."""
        typed = {var: tirx.Cast(str(var.ty), x) for var, x in bindings.items()}
        return T.address_of(load.source[tuple(substitute(index, typed) for index in load.indices)])

    def batch_of(z):
        """The batch iterators of flat batch index z (blockIdx.z)."""
        found, rest = {}, z
        for var, extent in reversed(list(zip(batch_vars, batch))):
            found[var], rest = rest % extent, rest // extent
        return found

    def copy_a(slot, tile, tx, by, bz, i):
        chunk = tx + i * consumers
        row, piece = chunk // 8, chunk % 8
        dst = slot * stage_elems + swizzled(row, piece * 8, bm)
        return dst, at(a_load, {**batch_of(bz), row_var: within_rows(by * bm + row), k_var: tile * K_TILE + piece * 8})

    def copy_b(slot, tile, tx, bx, bz, i):
        chunk = tx + i * consumers
        if b_n_major:  # [k, n]: 64-column atoms, each K_TILE rows of 128 bytes
            krow, piece = chunk // (bn // 8), chunk % (bn // 8)
            dst = slot * stage_elems + a_elems + swizzled(krow, piece * 8, K_TILE)
            return dst, at(b_load, {**batch_of(bz), k_var: tile * K_TILE + krow, col_var: within(bx * bn + piece * 8, n - 8)})
        col, piece = chunk // 8, chunk % 8  # [n, k]: rows of 64 k, like A
        dst = slot * stage_elems + a_elems + swizzled(col, piece * 8, bn)
        return dst, at(b_load, {**batch_of(bz), col_var: within(bx * bn + col, n - 1), k_var: tile * K_TILE + piece * 8})

    def indices(bz, row, col):
        """The output's indices at the matmul's row and column, and their bindings."""
        bindings = {var: tirx.Cast(str(var.ty), x) for var, x in zip(ep.ivs or ivs[:-1], [*batch_of(bz).values(), row, col])}
        return list(bindings.values()), bindings

    def result(bz, row, col, values):
        """What the output holds at row, col: the epilogue of the accumulator values (one per ep.loads)."""
        return values[0] if ep.ivs is None else substitute(ep.value, {**indices(bz, row, col)[1], **dict(zip(ep.loads, values))})

    def operands(acc, r):
        """The accumulators of the output's register-layout position r: acc[r]; gated (half as many
        positions), the gate's register and the up projection's, 4 later (gate_column)."""
        if not ep.gated:
            return [acc[r]]
        gate = r // 4 * 8 + r % 4
        return [acc[gate], acc[gate + 4]]

    operand = str(a_load.source.dtype)
    staged = str(out.dtype) == operand  # through shared memory (of the operands' type): 16-byte stores, not 2-byte ones
    out_bn, out_n = (bn // 2, n // 2) if ep.gated else (bn, n)  # the output tile's and the output's columns
    row_stride = out_bn + OUTPUT_PAD
    def raster(tile):
        """(column, row) of C's tile for block `tile`: with `group`, consecutive blocks walk down
        `group` rows of tiles before the next column (they share B's columns while in L2)."""
        if not group:
            return tile % columns, tile // columns
        per_group = group * columns
        if isinstance(rows, int):  # every group whole (`group` divides the rows of tiles)
            return tile % per_group // group, tile // per_group * group + tile % group
        first = tile // per_group * group  # a symbolic row count: the last group may be short
        height = T.min(rows - first, group)
        return tile % per_group // height, first + tile % per_group % height

    b_lbo = K_TILE * 128 // 16 if b_n_major else 1  # n-major: from one 64-column atom to the next
    b_step = 16 * 128 if b_n_major else 32  # bytes from one 16-wide step of k to the next
    trans_b = 1 if b_n_major else 0
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{WGMMA_TYPES[operand]}.{WGMMA_TYPES[operand]}"
    grid_z = math.prod(batch)

    if tma:
        a_view, b_view = views
        maps = [T.Var(name, ty=T.handle("tensormap").ty) for name in ("A_tensormap", "B_tensormap")]
        b_box = [64, K_TILE] if b_n_major else [K_TILE, bn]  # an n-major B: one load per 64-column atom
        host = [stmt for tensor_map, load, view, box in zip(maps, (a_load, b_load), (a_view, b_view), ([K_TILE, bm], b_box))
                for stmt in _encode(tensor_map, load, view, box)]
    a_map, b_map = maps if tma else (None, None)

    def tma_load(tensor_map, view, dst, inner, outer, bz, bar):
        """One TMA load of the box at (inner, outer) of the batch bz's slice, completing on `bar`."""
        coordinates = [inner, outer, *view[2](batch_of(bz))]
        T.evaluate(T.ptx[f"cp.async.bulk.tensor.{len(coordinates)}d.shared::cluster.global.mbarrier::complete_tx::bytes"](
            dst, T.address_of(tensor_map), *[T.Cast("int32", c) for c in coordinates], bar))

    def load_b(smem, slot, kt, bx, bz, bar):
        """B's tile for step kt (an n-major B: one load per 64-column atom)."""
        base = slot * stage_elems + a_elems
        if b_n_major:
            for j in range(bn // 64):
                tma_load(b_map, b_view, T.address_of(smem[base + j * 64 * K_TILE]), bx * bn + j * 64, kt * K_TILE, bz, bar)
        else:
            tma_load(b_map, b_view, T.address_of(smem[base]), kt * K_TILE, bx * bn, bz, bar)

    def multiply(acc, desc_a, desc_b, kt):
        """Step kt's wgmma group, D += A * B over its 64 of k from stage kt % stages, committed."""
        T.evaluate(T.ptx["wgmma.fence.sync.aligned"]())
        for kk in range(K_TILE // 16):
            T.evaluate(T.ptx[mma](*[acc[r] for r in range(regs)],
                                  desc_a[0] + T.uint64((kt % stages * stage_elems * 2 + kk * 32) // 16),
                                  desc_b[0] + T.uint64((kt % stages * stage_elems * 2 + kk * b_step) // 16),
                                  T.bool(True), 1, 1, 0, trans_b))
        T.evaluate(T.ptx["wgmma.commit_group.sync.aligned"]())

    @T.prim_func(check_well_formed=False)
    def kernel():
        bz = T.launch_thread("blockIdx.z", grid_z)
        tile = T.launch_thread("blockIdx.x", columns * rows)
        bx, by = T.meta_var(raster(tile)) if isinstance(rows, int) else raster(tile)  # symbolic: bound once (a short group's divisions)
        tx = T.launch_thread("threadIdx.x", threads)
        smem = T.alloc_buffer((stages * stage_elems + tma * stages * BARRIER_BYTES // 2,),  # fp16 elements: the barriers after the stages
                              operand, scope="shared.dyn", align=ATOM_BYTES)
        acc = T.alloc_buffer((regs,), "float32", scope="local")
        desc_a = T.alloc_buffer((1,), "uint64", scope="local")
        desc_b = T.alloc_buffer((1,), "uint64", scope="local")
        for r in T.unroll(regs):  # zeroed here rather than by scale-d 0 on the first step: never
            acc[r] = T.float32(0)  # slower (docs/design.md#warpgroup-matmuls-wgmma)
        T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(desc_a[0]), T.address_of(smem[tx // WARPGROUP * ROWS * K_TILE]), 1, ATOM_BYTES // 16, SWIZZLE_128B))
        T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(desc_b[0]), T.address_of(smem[a_elems]), b_lbo, ATOM_BYTES // 16, SWIZZLE_128B))
        if tma:  # a producer warp loads each stage by TMA once the consumers released it ("empty")
            bars = T.decl_buffer((2 * stages,), "uint64", data=smem.data, elem_offset=stages * stage_elems // 4,  # 4 fp16 a uint64
                                 scope="shared.dyn")
            if tx == 0:
                for s in range(stages):  # "full" barriers, then "empty" ones (released by each consumer warp)
                    T.ptx["mbarrier.init.shared::cta.b64"](T.address_of(bars[s]), 1)
                    T.ptx["mbarrier.init.shared::cta.b64"](T.address_of(bars[stages + s]), consumers // 32)
                T.ptx["fence.mbarrier_init.release.cluster"]()
            T.tvm_storage_sync("shared")
            if tx >= consumers:
                for kt in range(k_tiles):
                    if kt >= stages:  # the consumers' (kt // stages)-th release of this stage
                        T.cuda.mbarrier_wait(T.address_of(bars[stages + kt % stages]), (kt // stages + 1) % 2)
                    if tx == consumers:
                        T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](T.address_of(bars[kt % stages]), stage_elems * 2)
                        tma_load(a_map, a_view, T.address_of(smem[kt % stages * stage_elems]), kt * K_TILE, by * bm, bz,
                                 T.address_of(bars[kt % stages]))
                        load_b(smem, kt % stages, kt, bx, bz, T.address_of(bars[kt % stages]))
            else:
                for kt in range(k_tiles):
                    T.cuda.mbarrier_wait(T.address_of(bars[kt % stages]), kt // stages % 2)
                    multiply(acc, desc_a, desc_b, kt)
                    T.ptx["wgmma.wait_group.sync.aligned"](1)
                    if kt > 0 and tx % 32 == 0:  # tile kt - 1's group is done: its stage may be refilled
                        T.ptx["mbarrier.arrive.shared::cta.b64"](T.address_of(bars[stages + (kt - 1) % stages]))
                T.ptx["wgmma.wait_group.sync.aligned"](0)
        else:
            for tile in T.unroll(ahead):  # prologue: the first tiles, one commit group each
                for i in T.unroll(a_chunks):
                    dst, src = T.meta_var(copy_a(tile, tile, tx, by, bz, i))
                    T.ptx["cp.async.cg.shared.global"](T.address_of(smem[dst]), src, 16)
                for i in T.unroll(b_chunks):
                    dst, src = T.meta_var(copy_b(tile, tile, tx, bx, bz, i))
                    T.ptx["cp.async.cg.shared.global"](T.address_of(smem[dst]), src, 16)
                T.ptx["cp.async.commit_group"]()
            for kt in range(k_tiles):
                T.ptx["cp.async.wait_group"](ahead - 1)  # this thread's copies of tile kt have landed
                T.ptx["fence.proxy.async.shared::cta"]()  # generic-proxy writes, then wgmma's async reads
                T.tvm_storage_sync("shared")  # every thread's copies; every warpgroup is past its wait (tile kt - 1 - in_flight done)
                if kt + ahead < k_tiles:
                    for i in T.unroll(a_chunks):
                        dst, src = T.meta_var(copy_a((kt + ahead) % stages, kt + ahead, tx, by, bz, i))
                        T.ptx["cp.async.cg.shared.global"](T.address_of(smem[dst]), src, 16)
                    for i in T.unroll(b_chunks):
                        dst, src = T.meta_var(copy_b((kt + ahead) % stages, kt + ahead, tx, bx, bz, i))
                        T.ptx["cp.async.cg.shared.global"](T.address_of(smem[dst]), src, 16)
                T.ptx["cp.async.commit_group"]()  # (empty at the tail: the group count stays in step)
                multiply(acc, desc_a, desc_b, kt)
                T.ptx["wgmma.wait_group.sync.aligned"](in_flight)
            T.ptx["wgmma.wait_group.sync.aligned"](0)
        if staged:
            T.tvm_storage_sync("shared")  # every warpgroup's last wgmma has read its operands
            if tx < consumers:
                for r in T.unroll(regs // len(ep.loads)):
                    row, col = T.meta_var(accumulator_position(tx, r))
                    smem[row * row_stride + col] = result(bz, within_rows(by * bm + row), within(bx * out_bn + col, out_n - 1),
                                                          operands(acc, r))
            T.tvm_storage_sync("shared")
            if tx < consumers:
                for i in T.unroll(bm * out_bn // 8 // consumers):
                    if inside(bx * out_bn + (tx + i * consumers) % (out_bn // 8) * 8, out_n,  # 8 columns, all inside or none
                              by * bm + (tx + i * consumers) // (out_bn // 8)):
                        for v in T.vectorized(8):
                            row, col = T.meta_var(((tx + i * consumers) // (out_bn // 8), (tx + i * consumers) % (out_bn // 8) * 8 + v))
                            T.buffer_store(out, smem[row * row_stride + col], indices(bz, by * bm + row, bx * out_bn + col)[0])
        elif tx < consumers:
            for r in T.unroll(regs):
                row, col = T.meta_var(accumulator_position(tx, r))
                if inside(bx * bn + col, n, by * bm + row):
                    T.buffer_store(out, result(bz, by * bm + row, bx * bn + col, operands(acc, r)), indices(bz, by * bm + row, bx * bn + col)[0])

    return tirx.SeqStmt([*host, kernel.body]) if tma else kernel.body


def _tma_views(block):
    """_tensor_view of A (k inner, rows outer) and of B (k inner over a k-major B, else its
    columns), or None where either is indexed otherwise."""
    a_load, b_load = multiply_accumulate(block.body)
    *_, row_var, col_var, k_var = (iv.var for iv in block.iter_vars)
    b_axes = (k_var, col_var) if matmul.k_is_last(block)[1] else (col_var, k_var)
    views = _tensor_view(a_load, block, k_var, row_var), _tensor_view(b_load, block, *b_axes)
    return views if all(views) else None


def _encode(tensor_map, load, view, box) -> list:
    """Host statements making `tensor_map` the descriptor of `load`'s buffer seen as `view`, loading
    `box` (inner first) into 128-byte swizzled shared memory, as the wgmma descriptors read it."""
    dims, strides, _ = view
    rank = len(dims)
    box = [*box, 1][:rank]
    return [tirx.Bind(tensor_map, T.tvm_stack_alloca("tensormap", 1)),
            tirx.Evaluate(tirx.tensormap_encode_tiled(tensor_map, load.source.data, *dims, *strides, *box, *[1] * rank,
                                                      descriptor_dtype=str(load.source.dtype), rank=rank, swizzle=TMA_SWIZZLE_128B))]
