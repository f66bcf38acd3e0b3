"""GPU strategy for reductions across rows over too few columns to fill the GPU (`x.sum(0)` of a
[262144, 64] tensor): the rows are split over blocks too, in one launch.

A block takes `cols` threads (threadIdx.x) of `vec` adjacent columns each, one vector load a row,
over a chunk of rows; its `lanes` (threadIdx.y) sum strided rows in registers and meet in shared
memory. Each block stores its columns' partials and takes its column tile's ticket (`__threadfence`
+ `atomicAdd`, as grid_reduce); the last block of a tile sums the tile's partials with every thread
(all of a thread's loads unrolled, so their latencies overlap), runs the epilogue and resets the
counter. Counter and partials are zero-filled constant inputs (`ZEROED_INPUTS`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .analysis import COLUMN, ReducePattern, const_int
from .contracts import ZEROED_INPUTS
from .device import Device
from .grid_reduce import COMBINERS, buffer_decl, combiner_parts, copy_attrs, map_vars, placeholder, unflatten

NAME = "column_split"
UNROLL = 8  # rows a lane has in flight: its loads do not depend on each other
MIN_STEPS = 2  # each split gives a lane at least this many unrolled steps of rows
THREADS = 512  # a block's threads: cols x lanes
BLOCKS_PER_SM = 2  # splits x tiles: more blocks lengthen the last block's sum of partials for no gain
VECTOR_BYTES = 16
TAIL_UNROLL = 16  # partials the last block's threads load before adding


def _reduction(pattern: ReducePattern):
    """(block, combiner op, per-element value, identity) of the single column reduction, or None."""
    if pattern.layout != COLUMN or len(pattern.reductions) != 1 or pattern.row_outputs:
        return None
    if pattern.epilogue is not None and pattern.epilogue.dom_kind() != "S" * pattern.num_spatial:
        return None
    block = pattern.sch.get(pattern.reductions[0].block_rv)
    parts = combiner_parts(block)
    return None if parts is None else (block, *parts)


def _sizes(pattern: ReducePattern) -> tuple | None:
    """(columns, rows) of a static column reduction, else None."""
    columns, rows = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    return None if columns is None or rows is None else (columns, rows)


def _vectors(pattern: ReducePattern, columns: int) -> list[int]:
    """Vector widths a thread may take: up to 16 bytes of the widest input and 4 accumulator lanes
    (a float32x8 accumulator is not valid CUDA from TVM's codegen), dividing the columns."""
    widest = max((pattern.dtype_bytes(b) for b in pattern.input_buffers()), default=4)
    return [v for v in (1, 2, 4) if v * widest <= VECTOR_BYTES and columns % v == 0]


def _tile(vectors: int) -> int:
    """Threads along a row: its vectors split evenly into tiles of at most a 32-lane warp, so no
    tile has idle threads (a tile of a whole row reads memory contiguously at any width)."""
    tiles = -(-vectors // 32)
    return -(-vectors // tiles)


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    sizes = _sizes(pattern)
    if not device.is_gpu or sizes is None or _reduction(pattern) is None:
        return None
    columns, rows = sizes
    vec = _vectors(pattern, columns)[-1]
    cols = _tile(columns // vec)
    lanes = THREADS // cols // vec * vec
    tiles = -(-columns // (cols * vec))
    slots = device.sm_count * min(BLOCKS_PER_SM, device.resident_blocks(cols * lanes))
    if slots // tiles < 2:
        return None  # the column tiles fill the GPU alone (column_reduce)
    splits = min(slots // tiles, rows // (lanes * UNROLL * MIN_STEPS))
    if splits < 2:
        return None  # too few rows to share
    return {"strategy": NAME, "cols": cols, "lanes": lanes, "splits": splits, "vec": vec}


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point where the heuristic splits rows: 8..32 threads along columns, 8..64 lanes,
    2..1024 splits (powers of two, 1-8 blocks an SM, the heuristic's), each vector width, and the
    heuristic's point where it lies outside that grid (fewer than 8 threads along columns)."""
    chosen = default_knobs(pattern, device)
    if chosen is None:
        return []
    columns, rows = _sizes(pattern)
    waves = {k * device.sm_count for k in (1, 2, 4, 8)}  # a block or more on every SM
    grid = [{"strategy": NAME, "cols": cols, "lanes": lanes, "splits": splits, "vec": vec}
            for vec in _vectors(pattern, columns) for cols in (8, 16, 32) for lanes in (8, 16, 32, 64)
            if cols * lanes <= device.max_threads and lanes % vec == 0
            for splits in sorted({2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, chosen["splits"]} | waves)
            if -(-columns // (cols * vec)) * splits <= 4 * device.sm_count * device.resident_blocks(cols * lanes)
            and rows >= splits * lanes * UNROLL]
    return grid if chosen in grid else [chosen, *grid]


def _fold(combine: str, terms: list[str]) -> str:
    """The terms combined as a balanced tree: a short chain of dependent adds, and an expression
    shallow enough for TVMScript's parser at 512 lanes."""
    if len(terms) == 1:
        return terms[0]
    x, y = _fold(combine, terms[:len(terms) // 2]), _fold(combine, terms[len(terms) // 2:])
    return f"({x} + {y})" if combine == "+" else f"T.{combine}({x}, {y})"


def _template(func, sizes, tiles, splits, cols, lanes, vec, chunk, acc_dtype, combine, identity) -> str:
    """The kernel as TVMScript, with call_extern placeholders for the value and the epilogue."""
    columns, rows = sizes
    n_in = len(func.params) - 1
    i64 = lambda v: f"T.int64({v})"  # noqa: E731
    width = cols * vec  # columns of a tile
    params = [f"{p.name}: {buffer_decl(p)}" for p in func.params[:n_in]] + [
        f'cs_counter: T.Buffer(({i64(tiles)},), "int32")',
        f'cs_partials: T.Buffer(({i64(tiles * splits * width)},), "{acc_dtype}")',
        f"{func.params[-1].name}: {buffer_decl(func.params[-1])}"]
    B, G, C, L, V, W = (i64(n) for n in (tiles * splits, splits, cols, lanes, vec, width))
    steps = -(-chunk // (UNROLL * lanes))
    acc = lambda x, y: _fold(combine, [x, y])  # noqa: E731
    thread = f"ty * {C} + tx"
    column0 = f"bx // {G} * {W} + tx * {V}"
    row = f"bx % {G} * {i64(chunk)} + (o * {i64(UNROLL)} + u) * {L} + ty"
    guards = ([f"{column0} < {i64(columns)}"] if tiles * width != columns else []) + (
        [f"(o * {i64(UNROLL)} + u) * {L} + ty < {i64(chunk)}"] if steps * UNROLL * lanes != chunk else []) + (
        [f"{row} < {i64(rows)}"] if splits * chunk != rows else [])
    guard = " and ".join(guards) or "True"
    groups = lanes // vec  # the last block: thread t sums column t % W of splits t // W, + groups, ...
    rounds = -(-splits // groups)
    unroll = min(rounds, TAIL_UNROLL)
    split = f"(jo * {i64(unroll)} + ji) * {i64(groups)} + ({thread}) // {W}"
    # partials of other blocks: read past L1, which may hold a stale line from an earlier block
    theirs = (f'T.call_extern("{acc_dtype}", "__ldcg", '
              f"T.address_of(cs_partials[(bx // {G} * {G} + {split}) * {W} + ({thread}) % {W}]))")
    meet = lambda n: _fold(combine, [f"cs_red[{i64(k)} * {W} + {thread}]" for k in range(n)])  # noqa: E731
    return f'''
@T.prim_func(s_tir=True)
def column_split({", ".join(params)}):
    cs_acc = T.sblock_alloc_buffer(({V},), "{acc_dtype}", scope="local")
    cs_red = T.sblock_alloc_buffer(({i64(lanes * width)},), "{acc_dtype}", scope="shared")
    cs_last = T.sblock_alloc_buffer((T.int64(1),), "int32", scope="shared")
    for bx in T.thread_binding({B}, thread="blockIdx.x"):
        for ty in T.thread_binding({L}, thread="threadIdx.y"):
            for tx in T.thread_binding({C}, thread="threadIdx.x"):
                for v in T.vectorized({V}):
                    cs_acc[v] = {identity}
                for o in range({i64(steps)}):
                    for u in T.unroll({i64(UNROLL)}):
                        if {guard}:
                            for v in T.vectorized({V}):
                                cs_acc[v] = {acc("cs_acc[v]", f'T.call_extern("{acc_dtype}", "cs_value", {column0} + v, {row})')}
                for v in T.vectorized({V}):
                    cs_red[ty * {W} + tx * {V} + v] = cs_acc[v]
                T.tvm_storage_sync("shared")
                if {thread} < {W}:
                    cs_partials[bx * {W} + {thread}] = {meet(lanes)}
                    T.evaluate(T.call_extern("void", "__threadfence"))
                T.tvm_storage_sync("shared")
                if {thread} == T.int64(0):
                    ticket = T.call_extern("int32", "atomicAdd", T.address_of(cs_counter[bx // {G}]), 1)
                    cs_last[0] = T.Cast("int32", ticket == {splits - 1})
                T.tvm_storage_sync("shared")
                last: T.int32 = cs_last[0]
                if last == 1:
                    cs_acc[0] = {identity}
                    for jo in range({i64(-(-rounds // unroll))}):
                        for ji in T.unroll({i64(unroll)}):
                            if {split} < {G}:
                                cs_acc[0] = {acc("cs_acc[0]", theirs)}
                    cs_red[{thread}] = cs_acc[0]
                    T.tvm_storage_sync("shared")
                    if {thread} < {W}:
                        T.evaluate(T.call_extern("int32", "cs_finish", bx // {G} * {W} + {thread}, {meet(groups)}))
                        if {thread} == T.int64(0):
                            cs_counter[bx // {G}] = 0
'''


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    found, sizes = _reduction(pattern), _sizes(pattern)
    if not device.is_gpu or found is None or sizes is None:
        return None
    block, combiner, value, identity = found
    columns, rows = sizes
    cols, lanes, splits = (int(knobs[k]) for k in ("cols", "lanes", "splits"))
    vec = int(knobs.get("vec", 1))
    if (cols * lanes > device.max_threads or rows < splits * lanes * UNROLL or vec not in _vectors(pattern, columns)
            or lanes % vec):
        return None
    chunk = -(-rows // (splits * lanes)) * lanes  # a split's rows: whole rows a lane, the last step maybe partial
    splits, tiles = -(-rows // chunk), -(-columns // (cols * vec))
    func = pattern.sch.mod["main"]
    acc_dtype = str(block.writes[0].source.ty.dtype)
    src = _template(func, sizes, tiles, splits, cols, lanes, vec, chunk, acc_dtype, COMBINERS[combiner],
                    identity.script())
    grid = tvm.script.from_source(src)

    buffers = dict(zip(list(func.params), list(grid.params[:-3]) + [grid.params[-1]]))
    epilogue = pattern.epilogue and pattern.sch.get(pattern.epilogue.block_rv)
    spatial = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduced = [iv for iv in block.iter_vars if iv.iter_type != tirx.IterVar.DataPar]

    def splice_value(call):  # the template guards tiles and splits that run past the tensor
        c, r = call.args[1], call.args[2]
        return map_vars(value, {**buffers, **unflatten(spatial, c), **unflatten(reduced, r)})

    def splice_finish(stmt):
        c, total = stmt.value.args[1], stmt.value.args[2]
        target = epilogue if epilogue is not None else block
        store = target.body
        where = unflatten([iv for iv in target.iter_vars if iv.iter_type == tirx.IterVar.DataPar], c)
        result = total if epilogue is None else tvm_ffi.structural_map(
            store.value, (tvm.ir.TensorLoad, lambda e: total if e.source.same_as(block.writes[0].source) else e))
        stored = tirx.BufferStore(buffers.get(store.buffer, store.buffer), map_vars(result, {**buffers, **where}),
                                  [map_vars(i, where) for i in store.indices])
        return stored if tiles * cols * vec == columns else tirx.IfThenElse(c < columns, stored, None)

    is_value, is_finish = placeholder("cs_value"), placeholder("cs_finish")
    body = tvm_ffi.structural_map(grid.body, [
        (tvm.ir.Call, lambda e: splice_value(e) if is_value(e) else e),
        (tirx.Evaluate, lambda s: splice_finish(s) if is_finish(s.value) else s),
    ])
    zeroed = [([tiles], "int32"), ([tiles * splits * cols * vec], acc_dtype)]
    return s_tir.Schedule(copy_attrs(grid.with_body(body).with_attr(ZEROED_INPUTS, zeroed), func))
