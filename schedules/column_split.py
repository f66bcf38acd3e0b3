"""GPU strategy for reductions across rows over too few columns to fill the GPU (`x.sum(0)` of a
[262144, 64] tensor): the rows are split over blocks too, in one launch.

A block takes `cols` adjacent columns (threadIdx.x) of a chunk of rows, its `lanes` (threadIdx.y)
sum strided rows and meet in TVM's cross-thread reduction. Each block stores its column partials
and takes its column tile's ticket (`__threadfence` + `atomicAdd`, as grid_reduce); the last block
of a tile sums the tile's partials, runs the epilogue and resets the counter. Counter and partials
are zero-filled constant inputs (`ZEROED_INPUTS`)."""

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
MIN_STEPS = 4  # each split gives a lane at least this many unrolled steps of rows


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


def _tile(columns: int) -> int:
    """Adjacent columns a block takes: a whole 32-lane warp along a row where there are that many,
    else the columns rounded up to a power of two."""
    cols = 1
    while cols < min(columns, 32):
        cols *= 2
    return cols


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    sizes = _sizes(pattern)
    if not device.is_gpu or sizes is None or _reduction(pattern) is None:
        return None
    columns, rows = sizes
    cols = _tile(columns)
    lanes = device.max_threads // 2 // cols
    tiles = -(-columns // cols)
    slots = device.sm_count * device.resident_blocks(cols * lanes)
    splits = min(slots // tiles, rows // (lanes * UNROLL * MIN_STEPS))
    if splits < 2:
        return None  # the column tiles fill the GPU alone (column_reduce), or too few rows to share
    return {"strategy": NAME, "cols": cols, "lanes": lanes, "splits": splits}


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point where the heuristic splits rows: 8..32 columns, 8..64 lanes, 2..256 splits
    (powers of two and the heuristic's), and the heuristic's point where it lies outside that grid
    (fewer than 8 columns)."""
    chosen = default_knobs(pattern, device)
    if chosen is None:
        return []
    columns, rows = _sizes(pattern)
    grid = [{"strategy": NAME, "cols": cols, "lanes": lanes, "splits": splits}
            for cols in (8, 16, 32) for lanes in (8, 16, 32, 64) if cols * lanes <= device.max_threads
            for splits in sorted({2, 4, 8, 16, 32, 64, 128, 256, chosen["splits"]})
            if -(-columns // cols) * splits <= 4 * device.sm_count * device.resident_blocks(cols * lanes)
            and rows >= splits * lanes * UNROLL]
    return grid if chosen in grid else [chosen, *grid]


def _template(func, tiles, splits, cols, lanes, steps, acc_dtype, combine, identity) -> str:
    """The kernel as TVMScript, with call_extern placeholders for the value and the epilogue."""
    n_in = len(func.params) - 1
    i64 = lambda v: f"T.int64({v})"  # noqa: E731
    params = [f"{p.name}: {buffer_decl(p)}" for p in func.params[:n_in]] + [
        f'cs_counter: T.Buffer(({i64(tiles)},), "int32")',
        f'cs_partials: T.Buffer(({i64(tiles * splits * cols)},), "{acc_dtype}")',
        f"{func.params[-1].name}: {buffer_decl(func.params[-1])}"]
    whole_inputs = ", ".join(f"{p.name}[{', '.join(f'0:{int(d)}' for d in p.shape)}]" for p in func.params[:n_in])
    B, G, C, L = i64(tiles * splits), i64(splits), i64(cols), i64(lanes)
    chunk = steps * UNROLL * lanes
    acc = lambda x, y: f"{x} + {y}" if combine == "+" else f"T.{combine}({x}, {y})"  # noqa: E731
    column = f"vb // {G} * {C} + vc"
    row = f"vb % {G} * {i64(chunk)} + vk"
    # partials of other blocks: read past L1, which may hold a stale line from an earlier block
    theirs = f'T.call_extern("{acc_dtype}", "__ldcg", T.address_of(cs_partials[(vb // {G} * {G} + vj) * {C} + vc]))'
    rounds = -(-splits // lanes)
    return f'''
@T.prim_func(s_tir=True)
def column_split({", ".join(params)}):
    cs_part = T.sblock_alloc_buffer(({i64(tiles * splits * cols)},), "{acc_dtype}", scope="shared")
    cs_last = T.sblock_alloc_buffer(({B},), "int32", scope="shared")
    cs_tot = T.sblock_alloc_buffer(({i64(tiles * cols)},), "{acc_dtype}", scope="shared")
    for bx in T.thread_binding({B}, thread="blockIdx.x"):
        for tx in T.thread_binding({C}, thread="threadIdx.x"):
            for ty in T.thread_binding({L}, thread="threadIdx.y"):
                for o in range({i64(steps)}):
                    for u in T.unroll({i64(UNROLL)}):
                        with T.sblock("cs_chunk"):
                            vb = T.axis.spatial({B}, bx)
                            vc = T.axis.spatial({C}, tx)
                            vk = T.axis.reduce({i64(chunk)}, (o * {i64(UNROLL)} + u) * {L} + ty)
                            T.reads({whole_inputs})
                            T.writes(cs_part[vb * {C} + vc])
                            with T.init():
                                cs_part[vb * {C} + vc] = {identity}
                            cs_part[vb * {C} + vc] = {acc(f"cs_part[vb * {C} + vc]", f'T.call_extern("{acc_dtype}", "cs_value", {column}, {row})')}
        for tx in T.thread_binding({C}, thread="threadIdx.x"):
            for ty in T.thread_binding({L}, thread="threadIdx.y"):
                with T.sblock("cs_arrive"):
                    vb = T.axis.spatial({B}, bx)
                    vc = T.axis.spatial({C}, tx)
                    vt = T.axis.spatial({L}, ty)
                    T.reads(cs_part[vb * {C} + vc], cs_counter[vb // {G}])
                    T.writes(cs_partials[vb * {C} + vc], cs_counter[vb // {G}], cs_last[vb])
                    if vt == T.int64(0):
                        cs_partials[vb * {C} + vc] = cs_part[vb * {C} + vc]
                        T.evaluate(T.call_extern("void", "__threadfence"))
                    T.evaluate(T.tvm_storage_sync("shared"))
                    if vt == T.int64(0) and vc == T.int64(0):
                        ticket = T.call_extern("int32", "atomicAdd", T.address_of(cs_counter[vb // {G}]), 1)
                        cs_last[vb] = T.Cast("int32", ticket == {splits - 1})
        for tx in T.thread_binding({C}, thread="threadIdx.x"):
            for j in range({i64(rounds)}):
                for ty in T.thread_binding({L}, thread="threadIdx.y"):
                    with T.sblock("cs_total"):
                        vb = T.axis.spatial({B}, bx)
                        vc = T.axis.spatial({C}, tx)
                        vj = T.axis.reduce({i64(rounds * lanes)}, j * {L} + ty)
                        T.where(j * {L} + ty < {G})
                        T.reads(cs_last[vb], cs_partials[vb // {G} * {G} * {C}:(vb // {G} + 1) * {G} * {C}])
                        T.writes(cs_tot[vb // {G} * {C} + vc])
                        with T.init():
                            cs_tot[vb // {G} * {C} + vc] = {identity}
                        cs_tot[vb // {G} * {C} + vc] = {acc(f"cs_tot[vb // {G} * {C} + vc]", f"T.if_then_else(cs_last[vb] == 1, {theirs}, {identity})")}
        for tx in T.thread_binding({C}, thread="threadIdx.x"):
            for ty in T.thread_binding({L}, thread="threadIdx.y"):
                with T.sblock("cs_finish"):
                    vb = T.axis.spatial({B}, bx)
                    vc = T.axis.spatial({C}, tx)
                    vt = T.axis.spatial({L}, ty)
                    T.reads(cs_last[vb], cs_tot[vb // {G} * {C} + vc])
                    T.writes(cs_counter[vb // {G}])
                    last: T.int32 = cs_last[vb]
                    if vt == T.int64(0) and last == 1:
                        T.evaluate(T.call_extern("int32", "cs_finish", {column}, cs_tot[vb // {G} * {C} + vc]))
                        if vc == T.int64(0):
                            cs_counter[vb // {G}] = 0
'''


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    found, sizes = _reduction(pattern), _sizes(pattern)
    if not device.is_gpu or found is None or sizes is None:
        return None
    block, combiner, value, identity = found
    columns, rows = sizes
    cols, lanes, splits = int(knobs["cols"]), int(knobs["lanes"]), int(knobs["splits"])
    if cols * lanes > device.max_threads or rows < splits * lanes * UNROLL:
        return None
    steps = -(-rows // (splits * lanes * UNROLL))
    chunk = steps * UNROLL * lanes
    splits, tiles = -(-rows // chunk), -(-columns // cols)  # whole steps a split: maybe fewer splits
    func = pattern.sch.mod["main"]
    acc_dtype = str(block.writes[0].source.ty.dtype)
    src = _template(func, tiles, splits, cols, lanes, steps, acc_dtype, COMBINERS[combiner], identity.script())
    grid = tvm.script.from_source(src)

    buffers = dict(zip(list(func.params), list(grid.params[:-3]) + [grid.params[-1]]))
    epilogue = pattern.epilogue and pattern.sch.get(pattern.epilogue.block_rv)
    spatial = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduced = [iv for iv in block.iter_vars if iv.iter_type != tirx.IterVar.DataPar]

    def splice_value(call):
        c, r = call.args[1], call.args[2]
        spliced = map_vars(value, {**buffers, **unflatten(spatial, c), **unflatten(reduced, r)})
        # the tiles and splits may run past the tensor: mask the value (a predicate on the block
        # that mentions blockIdx would stop TVM's cross-thread lowering)
        inside = [c < columns] if tiles * cols != columns else []
        inside += [r < rows] if splits * chunk != rows else []
        if not inside:
            return spliced
        return tirx.if_then_else(inside[0] if len(inside) == 1 else tirx.And(*inside), spliced, identity)

    def splice_finish(stmt):
        c, total = stmt.value.args[1], stmt.value.args[2]
        target = epilogue if epilogue is not None else block
        store = target.body
        where = unflatten([iv for iv in target.iter_vars if iv.iter_type == tirx.IterVar.DataPar], c)
        result = total if epilogue is None else tvm_ffi.structural_map(
            store.value, (tvm.ir.TensorLoad, lambda e: total if e.source.same_as(block.writes[0].source) else e))
        stored = tirx.BufferStore(buffers.get(store.buffer, store.buffer), map_vars(result, {**buffers, **where}),
                                  [map_vars(i, where) for i in store.indices])
        return stored if tiles * cols == columns else tirx.IfThenElse(c < columns, stored, None)

    is_value, is_finish = placeholder("cs_value"), placeholder("cs_finish")
    body = tvm_ffi.structural_map(grid.body, [
        (tvm.ir.Call, lambda e: splice_value(e) if is_value(e) else e),
        (tirx.Evaluate, lambda s: splice_finish(s) if is_finish(s.value) else s),
    ])
    zeroed = [([tiles], "int32"), ([tiles * splits * cols], acc_dtype)]
    return s_tir.Schedule(copy_attrs(grid.with_body(body).with_attr(ZEROED_INPUTS, zeroed), func))
