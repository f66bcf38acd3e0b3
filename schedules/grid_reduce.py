"""GPU strategy for few rows with a huge reduce axis: several blocks per row in one launch.

Blocks store partials and take a per-row ticket (`__threadfence` + `atomicAdd`); the last combines,
runs the epilogue and resets the counter. Counter and partials are zero-filled constant inputs
(`ZEROED_INPUTS`). The inter-block protocol is written as s_tir: no schedule primitive expresses it."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .analysis import ROW, ReducePattern, const_int
from .contracts import ZEROED_INPUTS, extern_name
from .device import Device
from .rows import vector_choices, vector_lanes

NAME = "grid_reduce"
MIN_ROW = 16384  # shorter rows are cheaper one block each
MAX_THREADS = 1024
COMBINERS = {tirx.Add: "+", tirx.Max: "max", tirx.Min: "min"}


def combiner_parts(block) -> tuple | None:
    """(combiner op, per-element value, identity) of a reduction block `acc = acc <op> value`, or None."""
    update = block.body
    if not isinstance(update, tirx.BufferStore) or type(update.value) not in COMBINERS or block.init is None:
        return None
    a, b = update.value.a, update.value.b
    is_acc = lambda e: isinstance(e, tvm.ir.TensorLoad) and e.source.same_as(update.buffer)  # noqa: E731
    value = b if is_acc(a) else a if is_acc(b) else None
    return None if value is None else (type(update.value), value, block.init.value)


def _reduction(pattern: ReducePattern):
    """(block, combiner op, per-element value, identity) of the single reduction, or None.

    None as well when an epilogue works on every element (RMSNorm's scale): that needs a
    grid-wide barrier between the reduction and the epilogue (grid_sync), not a last block.
    """
    if len(pattern.reductions) != 1 or pattern.num_spatial != 1 or pattern.row_outputs:
        return None
    if pattern.epilogue is not None and pattern.epilogue.dom_kind() not in ("S", ""):
        return None  # "": the one value of a whole-tensor reduction
    block = pattern.sch.get(pattern.reductions[0].block_rv)
    parts = combiner_parts(block)
    return None if parts is None else (block, *parts)


def joint_allocation(device: Device, rows: int) -> tuple[int, int, float]:
    """CINN's thread-block joint allocation: (threads, blocks per row, share of SM slots used).

    The grid is a multiple of the row count, so a whole number of blocks per row rarely fills the
    GPU's resident-block slots; shrinking the block by F = 1..4 multiplies the slots, and the F
    whose single wave fills the most of them wins (the larger block on a tie).
    """
    best = None
    for scale in (1, 2, 3, 4):
        threads = max(device.warp, MAX_THREADS // scale // device.warp * device.warp)
        slots = device.sm_count * device.resident_blocks(threads)
        per_row = max(1, slots // rows)
        used = rows * per_row / (slots * -(-rows * per_row // slots))
        if best is None or used > best[2] + 1e-9:
            best = (threads, per_row, used)
    return best


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    rows, width = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    if not device.is_gpu or pattern.layout != ROW or rows is None or width is None or _reduction(pattern) is None:
        return None
    if width < MIN_ROW or rows >= device.sm_count * device.resident_blocks(MAX_THREADS // 2):
        return None  # enough rows to fill the GPU one block each
    threads, per_row, _ = joint_allocation(device, rows)
    return {"strategy": NAME, "blocks_per_row": max(2, per_row), "threads": threads, "vec": vector_lanes(pattern)}


def buffer_decl(buf) -> str:
    dims = [f"T.int64({int(d)})" for d in buf.shape]
    return f'T.Buffer(({", ".join(dims)}{"," if len(dims) == 1 else ""}), "{buf.ty.dtype}")'


def _template(func, rows, blocks, threads, vec, chunk, width, acc_dtype, combine, identity) -> str:
    """The kernel as TVMScript, with call_extern placeholders for the value and the epilogue."""
    n_in = len(func.params) - 1
    params = [f"{p.name}: {buffer_decl(p)}" for p in func.params[:n_in]] + [
        f'gr_counter: T.Buffer((T.int64({rows}),), "int32")',
        f'gr_partials: T.Buffer((T.int64({rows * blocks}),), "{acc_dtype}")',
        f"{func.params[-1].name}: {buffer_decl(func.params[-1])}"]
    i64 = lambda v: f"T.int64({v})"  # noqa: E731
    # conservative: the spliced value may read any input anywhere
    whole_inputs = ", ".join(f"{p.name}[{', '.join(f'0:{int(d)}' for d in p.shape)}]" for p in func.params[:n_in])
    G, B = i64(blocks), i64(rows * blocks)
    acc = lambda x, y: f"{x} + {y}" if combine == "+" else f"T.{combine}({x}, {y})"  # noqa: E731
    k = f"vb % {G} * {i64(chunk)} + vk"

    # partials of other blocks: read past L1, which may hold a stale line from an earlier block
    mine = f'T.call_extern("{acc_dtype}", "__ldcg", T.address_of(gr_partials[vb // {G} * {G} + vj]))'
    return f'''
@T.prim_func(s_tir=True)
def grid_reduce({", ".join(params)}):
    gr_part = T.sblock_alloc_buffer(({B},), "{acc_dtype}", scope="shared")
    gr_last = T.sblock_alloc_buffer(({B},), "int32", scope="shared")
    gr_tot = T.sblock_alloc_buffer(({i64(rows)},), "{acc_dtype}", scope="shared")
    for bx in T.thread_binding({B}, thread="blockIdx.x"):
        for tx in T.thread_binding({i64(threads)}, thread="threadIdx.x"):
            for o in range({i64(chunk // (threads * vec))}):
                for v in T.unroll({i64(vec)}):
                    with T.sblock("gr_chunk"):
                        vb = T.axis.spatial({B}, bx)
                        vk = T.axis.reduce({i64(chunk)}, (o * {i64(threads)} + tx) * {i64(vec)} + v)
                        T.reads({whole_inputs})
                        T.writes(gr_part[vb])
                        with T.init():
                            gr_part[vb] = {identity}
                        gr_part[vb] = {acc("gr_part[vb]", f'T.call_extern("{acc_dtype}", "gr_value", vb // {G}, {k})')}
        for tx in T.thread_binding({i64(threads)}, thread="threadIdx.x"):
            with T.sblock("gr_arrive"):
                vb = T.axis.spatial({B}, bx)
                vt = T.axis.spatial({i64(threads)}, tx)
                T.reads(gr_part[vb], gr_counter[vb // {G}])
                T.writes(gr_partials[vb], gr_counter[vb // {G}], gr_last[vb])
                if vt == T.int64(0):
                    gr_partials[vb] = gr_part[vb]
                    T.evaluate(T.call_extern("void", "__threadfence"))
                    ticket = T.call_extern("int32", "atomicAdd", T.address_of(gr_counter[vb // {G}]), 1)
                    gr_last[vb] = T.Cast("int32", ticket == {blocks - 1})
        for j in range({i64(-(-blocks // threads))}):
            for tx in T.thread_binding({i64(threads)}, thread="threadIdx.x"):
                with T.sblock("gr_total"):
                    vb = T.axis.spatial({B}, bx)
                    vj = T.axis.reduce({i64(-(-blocks // threads) * threads)}, j * {i64(threads)} + tx)
                    T.where(j * {i64(threads)} + tx < {G})
                    T.reads(gr_last[vb], gr_partials[vb // {G} * {G} + vj])
                    T.writes(gr_tot[vb // {G}])
                    with T.init():
                        gr_tot[vb // {G}] = {identity}
                    gr_tot[vb // {G}] = {acc(f"gr_tot[vb // {G}]", f"T.if_then_else(gr_last[vb] == 1, {mine}, {identity})")}
        for tx in T.thread_binding({i64(threads)}, thread="threadIdx.x"):
            with T.sblock("gr_finish"):
                vb = T.axis.spatial({B}, bx)
                vt = T.axis.spatial({i64(threads)}, tx)
                T.reads(gr_last[vb], gr_tot[vb // {G}])
                T.writes(gr_counter[vb // {G}])
                last: T.int32 = gr_last[vb]
                if vt == T.int64(0) and last == 1:
                    T.evaluate(T.call_extern("int32", "gr_finish", vb // {G}, gr_tot[vb // {G}]))
                    gr_counter[vb // {G}] = 0
'''


def map_vars(expr, mapping):
    def var(v):
        return next((new for old, new in mapping.items() if old.same_as(v)), v)

    def load(e):
        return tirx.BufferLoad(var(e.source), e.indices)

    return tvm_ffi.structural_map(expr, [(tirx.Var, var), (tvm.ir.TensorLoad, load)])


def unflatten(iter_vars, flat) -> dict:
    """Map `iter_vars` (row-major, static extents) to the position `flat` of their flattened space."""
    mapping, rest = {}, flat
    for iv in reversed(list(iter_vars)[1:]):
        mapping[iv.var], rest = rest % int(iv.dom.extent), rest // int(iv.dom.extent)
    if iter_vars:
        mapping[iter_vars[0].var] = rest
    return mapping


def row_element_vars(block, row, k) -> dict:
    """Map a [row, reduce...] block's iter vars to row `row` and flat position `k` in the row (a
    block over rows alone takes the row only)."""
    first, *rest_vars = block.iter_vars
    return {first.var: row, **unflatten(rest_vars, k)}


def placeholder(name: str):
    """A test for the call_extern("name", ...) that a TVMScript template leaves to be spliced."""
    return lambda e: extern_name(e) == name


def copy_attrs(template: tirx.PrimFunc, func: tirx.PrimFunc) -> tirx.PrimFunc:
    for key, attr in func.attrs.items() if func.attrs else []:
        template = template.with_attr(key, attr)
    return template


def grid_split(pattern: ReducePattern, device: Device, knobs: dict) -> tuple | None:
    """(rows, width, blocks per row, threads, vec, chunk) for static rows split over blocks: each
    block takes a chunk of whole threads x vec steps (so the block count may come out lower)."""
    rows, width = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    if not device.is_gpu or pattern.layout != ROW or rows is None or width is None:
        return None
    blocks, threads, vec = int(knobs["blocks_per_row"]), int(knobs["threads"]), int(knobs.get("vec", 1))
    step = threads * vec
    chunk = -(-(-(-width // blocks)) // step) * step
    return rows, width, -(-width // chunk), threads, vec, chunk


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point where the heuristic would consider a grid: 256..1024 threads, 2.. blocks per
    row (powers of two and the heuristic's), each vector width dividing the row."""
    chosen = default_knobs(pattern, device)
    if chosen is None:
        return []
    rows = const_int(pattern.row_count)
    return [{"strategy": NAME, "blocks_per_row": blocks, "threads": threads, "vec": vec}
            for threads in (256, 512, 1024)
            for blocks in sorted({2, 4, 8, 16, 32, 64, 128, 256, 512, chosen["blocks_per_row"]})
            if rows * blocks <= 2 * device.sm_count * device.resident_blocks(threads)
            for vec in vector_choices(pattern)]


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    found, split = _reduction(pattern), grid_split(pattern, device, knobs)
    if found is None or split is None:
        return None
    block, combiner, value, identity = found
    rows, width, blocks, threads, vec, chunk = split
    func = pattern.sch.mod["main"]
    acc_dtype = str(block.writes[0].source.ty.dtype)
    combine = COMBINERS[combiner]
    src = _template(func, rows, blocks, threads, vec, chunk, width, acc_dtype, combine, identity.script())
    grid = tvm.script.from_source(src)

    originals = list(func.params[:-1]) + [func.params[-1]]
    fresh = list(grid.params[:-3]) + [grid.params[-1]]
    buffers = dict(zip(originals, fresh))
    epilogue = pattern.epilogue and pattern.sch.get(pattern.epilogue.block_rv)

    def splice_value(call):
        k = call.args[2]
        spliced = map_vars(value, {**buffers, **row_element_vars(block, call.args[1], k)})
        # the last block's chunk may run past the row: a predicate (T.where) on the block would
        # stop TVM's cross-thread lowering (it mentions blockIdx), so mask the value instead
        return spliced if chunk * blocks == width else tirx.if_then_else(k < width, spliced, identity)

    def splice_finish(stmt):
        r, total = stmt.value.args[1], stmt.value.args[2]
        target = epilogue if epilogue is not None else block
        store = target.body
        row = {target.iter_vars[0].var: r} if target.iter_vars else {}
        reduced = block.writes[0].source
        result = total if epilogue is None else tvm_ffi.structural_map(
            store.value, (tvm.ir.TensorLoad, lambda e: total if e.source.same_as(reduced) else e))
        return tirx.BufferStore(buffers.get(store.buffer, store.buffer),
                                map_vars(result, {**buffers, **row}),
                                [map_vars(i, row) for i in store.indices])

    is_value, is_finish = placeholder("gr_value"), placeholder("gr_finish")
    body = tvm_ffi.structural_map(grid.body, [
        (tvm.ir.Call, lambda e: splice_value(e) if is_value(e) else e),
        (tirx.Evaluate, lambda s: splice_finish(s) if is_finish(s.value) else s),
    ])
    zeroed = [([rows], "int32"), ([rows * blocks], acc_dtype)]
    return s_tir.Schedule(copy_attrs(grid.with_body(body).with_attr(ZEROED_INPUTS, zeroed), func))
