"""GPU strategy for few, huge rows whose reductions feed work on every element (RMSNorm, softmax).

One cooperative kernel launch: `blocks_per_row` blocks share each row. For each reduction in
turn, every block reduces its chunk, publishes the partial, and waits at a grid-wide barrier
(`cooperative_groups::this_grid().sync()`); then every block combines its row's partials itself
and goes on, so a reduction may use the ones before it (softmax: max, then the sum of
exp(x - max)) and the epilogue runs on each block's own chunk in the same kernel.

A grid barrier is only safe when every block is resident at once. The kernel is therefore
launched cooperatively (the driver refuses a grid that cannot be co-resident instead of
hanging); tvm_ext/passes/cooperative_launch.py asks for that launch and supplies the header.
Grids are sized to half the SM's thread slots so that up to 64 registers per thread still fit.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .analysis import ROW, ReducePattern, const_int
from .device import Device
from .grid_reduce import (COMBINERS, MIN_ROW, ZEROED_INPUTS, buffer_decl, combiner_parts, copy_attrs, map_vars,
                          placeholder, row_element_vars)
from .rows import MAX_EPILOGUE_LANES, vector_lanes

NAME = "grid_sync"
GRID_SYNC = "cooperative_groups::this_grid().sync"  # printed by CUDA codegen as a call
THREADS = 512


def cooperative_slots(device: Device, threads: int) -> int:
    """Blocks of `threads` a cooperative grid may hold: half the SM thread slots (<= 64 registers/thread)."""
    return device.sm_count * max(1, device.threads_per_sm // 2 // threads)


def _chain(pattern: ReducePattern):
    """[(block, combiner, value, identity)] of the reductions, and the epilogue block; or None."""
    if pattern.num_spatial != 1 or pattern.row_outputs or pattern.epilogue is None:
        return None
    epilogue = pattern.sch.get(pattern.epilogue.block_rv)
    reductions = [pattern.sch.get(info.block_rv) for info in pattern.reductions]
    parts = [combiner_parts(block) for block in reductions]
    if any(p is None for p in parts):
        return None
    # the epilogue must walk [row, reduce dims...] in the reductions' order: we map its vars that way
    row_dims = [int(iv.dom.extent) for iv in reductions[0].iter_vars]
    if [const_int(iv.dom.extent) for iv in epilogue.iter_vars] != row_dims:
        return None
    return [(block, *p) for block, p in zip(reductions, parts)], epilogue


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    rows, width = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    if not device.is_gpu or pattern.layout != ROW or rows is None or width is None or _chain(pattern) is None:
        return None
    slots = cooperative_slots(device, THREADS)
    if width < MIN_ROW or rows * 2 > slots:
        return None  # rows enough to fill the GPU one block each: a row-per-block schedule needs no barrier
    return {"strategy": NAME, "blocks_per_row": slots // rows, "threads": THREADS, "vec": vector_lanes(pattern)}


def _template(func, reductions, rows, blocks, threads, vec, chunk, width, staged) -> str:
    """The kernel as TVMScript; call_extern placeholders stand for the spliced values and epilogue.

    Placeholders get (row, position in the row, block, position in the block's chunk). With
    `staged` (an input's name), the block first copies its chunk of that input into shared memory
    in 16-byte pieces, so HBM sees it once however many passes read it.
    """
    n_in, n_red, B, G = len(func.params) - 1, len(reductions), rows * blocks, blocks
    i64 = lambda v: f"T.int64({v})"  # noqa: E731
    params = [f"{p.name}: {buffer_decl(p)}" for p in func.params[:n_in]]
    params += [f'gs_partials{i}: T.Buffer(({i64(B)},), "{dtype}")' for i, (dtype, _, _) in enumerate(reductions)]
    params.append(f"{func.params[-1].name}: {buffer_decl(func.params[-1])}")
    inputs = [f"{p.name}[{', '.join(f'0:{int(d)}' for d in p.shape)}]" for p in func.params[:n_in]]
    inputs += [f"gs_x[0:{i64(chunk)}]"] if staged else []
    G_, B_, T_ = i64(G), i64(B), i64(threads)
    tail = chunk * blocks != width
    lines = ["@T.prim_func(s_tir=True)", f"def grid_sync({', '.join(params)}):"]
    lines += [f'    gs_tot{i} = T.sblock_alloc_buffer(({B_},), "{d}", scope="shared")' for i, (d, _, _) in enumerate(reductions)]
    lines += [f'    gs_part{i} = T.sblock_alloc_buffer(({B_},), "{d}", scope="shared")' for i, (d, _, _) in enumerate(reductions)]
    if staged:
        x = next(p for p in func.params if p.name == staged)
        lines.append(f'    gs_x = T.sblock_alloc_buffer(({i64(chunk)},), "{x.ty.dtype}", scope="shared.dyn")')
    lines.append(f'    for bx in T.thread_binding({B_}, thread="blockIdx.x"):')
    if staged:
        lines.append(f'''
        for o in range({i64(chunk // (threads * vec))}):
            for tx in T.thread_binding({T_}, thread="threadIdx.x"):
                for v in {"T.unroll" if tail else "T.vectorized"}({i64(vec)}):
                    with T.sblock("gs_stage"):
                        vb = T.axis.spatial({B_}, bx)
                        ve = T.axis.spatial({i64(chunk)}, (o * {T_} + tx) * {i64(vec)} + v)
                        T.where(bx % {G_} * {i64(chunk)} + (o * {T_} + tx) * {i64(vec)} + v < {i64(width)})
                        T.reads({staged}[vb // {G_}, vb % {G_} * {i64(chunk)} + ve])
                        T.writes(gs_x[ve])
                        gs_x[ve] = {staged}[vb // {G_}, vb % {G_} * {i64(chunk)} + ve]''')
    for i, (dtype, combine, identity) in enumerate(reductions):
        acc = (lambda x, y: f"{x} + {y}") if combine == "+" else (lambda x, y, c=combine: f"T.{c}({x}, {y})")
        other = f'T.call_extern("{dtype}", "__ldcg", T.address_of(gs_partials{i}[vb // {G_} * {G_} + vj]))'
        earlier = "".join(f", gs_tot{j}[vb]" for j in range(i))
        # consecutive threads take consecutive elements: coalesced in HBM, conflict-free in shared memory
        lines.append(f'''
        for tx in T.thread_binding({T_}, thread="threadIdx.x"):
            for o in range({i64(chunk // (threads * vec))}):
                for v in T.unroll({i64(vec)}):
                    with T.sblock("gs_chunk{i}"):
                        vb = T.axis.spatial({B_}, bx)
                        vk = T.axis.reduce({i64(chunk)}, (o * {i64(vec)} + v) * {T_} + tx)
                        T.reads({", ".join(inputs)}{earlier})
                        T.writes(gs_part{i}[vb])
                        with T.init():
                            gs_part{i}[vb] = {identity}
                        gs_part{i}[vb] = {acc(f"gs_part{i}[vb]", f'T.call_extern("{dtype}", "gs_value{i}", vb // {G_}, vb % {G_} * {i64(chunk)} + vk, vb, vk)')}
        for tx in T.thread_binding({T_}, thread="threadIdx.x"):
            with T.sblock("gs_publish{i}"):
                vb = T.axis.spatial({B_}, bx)
                vt = T.axis.spatial({T_}, tx)
                T.reads(gs_part{i}[vb])
                T.writes(gs_partials{i}[vb])
                if vt == T.int64(0):
                    gs_partials{i}[vb] = gs_part{i}[vb]
                    T.evaluate(T.call_extern("void", "__threadfence"))
                T.evaluate(T.call_extern("void", "{GRID_SYNC}"))
        for j in range({i64(-(-blocks // threads))}):
            for tx in T.thread_binding({T_}, thread="threadIdx.x"):
                with T.sblock("gs_total{i}"):
                    vb = T.axis.spatial({B_}, bx)
                    vj = T.axis.reduce({i64(-(-blocks // threads) * threads)}, j * {T_} + tx)
                    T.where(j * {T_} + tx < {G_})
                    T.reads(gs_partials{i}[vb // {G_} * {G_} + vj])
                    T.writes(gs_tot{i}[vb])
                    with T.init():
                        gs_tot{i}[vb] = {identity}
                    gs_tot{i}[vb] = {acc(f"gs_tot{i}[vb]", other)}''')
    lanes = 1 if tail else min(vec, MAX_EPILOGUE_LANES)
    out = func.params[-1]
    totals = "".join(f", gs_tot{i}[vb]" for i in range(n_red))
    lines.append(f'''
        for o in range({i64(chunk // (threads * lanes))}):
            for tx in T.thread_binding({T_}, thread="threadIdx.x"):
                for v in {"T.vectorized" if lanes > 1 else "T.unroll"}({i64(lanes)}):
                    with T.sblock("gs_epilogue"):
                        vb = T.axis.spatial({B_}, bx)
                        ve = T.axis.spatial({i64(chunk)}, (o * {T_} + tx) * {i64(lanes)} + v)
                        T.where(bx % {G_} * {i64(chunk)} + (o * {T_} + tx) * {i64(lanes)} + v < {i64(width)})
                        T.reads({", ".join(inputs)}{totals})
                        T.writes({out.name}[{", ".join(f"0:{int(d)}" for d in out.shape)}])
                        T.evaluate(T.call_extern("void", "gs_epilogue", vb // {G_}, vb % {G_} * {i64(chunk)} + ve, vb, ve))''')
    return "\n".join(lines) + "\n"


def _staged_input(pattern: ReducePattern, chunk: int, device: Device) -> str | None:
    """The [rows, width] input to keep in shared memory, if its chunk fits (None: re-read it)."""
    func = pattern.sch.mod["main"]
    rows, width = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    for buf in pattern.input_buffers():
        shape = [const_int(d) for d in buf.shape]
        fits = chunk * pattern.dtype_bytes(buf) <= device.smem_bytes // 2 // 1024 * 1024  # 2 blocks per SM
        if shape == [rows, width] and fits and any(buf.same_as(p) for p in func.params):
            return buf.name
    return None


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    found = _chain(pattern)
    rows, width = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    if not device.is_gpu or pattern.layout != ROW or found is None or rows is None or width is None:
        return None
    chain, epilogue = found
    blocks, threads, vec = int(knobs["blocks_per_row"]), int(knobs["threads"]), int(knobs.get("vec", 1))
    step = threads * vec
    chunk = -(-(-(-width // blocks)) // step) * step  # a row's share per block, whole steps
    blocks = -(-width // chunk)
    if rows * blocks > cooperative_slots(device, threads):
        return None  # not co-resident: the cooperative launch would be refused
    func = pattern.sch.mod["main"]
    staged = _staged_input(pattern, chunk, device) if knobs.get("cache", True) else None
    reductions = [(str(b.writes[0].source.ty.dtype), COMBINERS[c], ident.script()) for b, c, _, ident in chain]
    grid = tvm.script.from_source(_template(func, reductions, rows, blocks, threads, vec, chunk, width, staged))

    buffers = dict(zip(func.params, list(grid.params[:len(func.params) - 1]) + [grid.params[-1]]))
    local = {}
    tvm_ffi.structural_walk(grid.body, (s_tir.SBlock, lambda b: local.update(
        {buf.name: buf for buf in b.alloc_buffers})), order="pre")

    def resolve(expr, block, row, k, vb, ve):
        """`expr` of `block` at (row, k): inputs renamed, the staged one read from shared memory,
        earlier reductions read from their totals."""
        own = [iv.var for iv in block.iter_vars]

        def load(e):
            for i, (b, *_) in enumerate(chain):
                if e.source.same_as(b.writes[0].source):
                    return tirx.BufferLoad(local[f"gs_tot{i}"], [vb])
            at_element = len(e.indices) == len(own) and all(i.same_as(v) for i, v in zip(e.indices, own))
            if staged and e.source.name == staged and at_element:
                return tirx.BufferLoad(local["gs_x"], [ve])
            return e

        expr = tvm_ffi.structural_map(expr, (tvm.ir.TensorLoad, load))
        return map_vars(expr, {**buffers, **row_element_vars(block, row, k)})

    def splice_value(call):
        block, _, value, identity = chain[int(call.args[0].value.removeprefix("gs_value"))]
        row, k, vb, ve = call.args[1:5]
        spliced = resolve(value, block, row, k, vb, ve)
        # a predicate (T.where) on a reduction block that mentions blockIdx stops TVM's
        # cross-thread lowering, so the last block's overhang is masked in the value instead
        return spliced if chunk * blocks == width else tirx.if_then_else(k < width, spliced, identity)

    def splice_epilogue(stmt):
        row, k, vb, ve = stmt.value.args[1:5]
        store = epilogue.body
        return tirx.BufferStore(buffers.get(store.buffer, store.buffer), resolve(store.value, epilogue, row, k, vb, ve),
                                [map_vars(i, row_element_vars(epilogue, row, k)) for i in store.indices])

    is_epilogue = placeholder("gs_epilogue")
    is_value = lambda e: isinstance(e.op, tvm.ir.Op) and e.op.name == "tirx.call_extern" and str(  # noqa: E731
        e.args[0].value).startswith("gs_value")
    body = tvm_ffi.structural_map(grid.body, [
        (tvm.ir.Call, lambda e: splice_value(e) if is_value(e) else e),
        (tirx.Evaluate, lambda s: splice_epilogue(s) if isinstance(s.value, tvm.ir.Call) and is_epilogue(s.value) else s),
    ])
    workspace = [([rows * blocks], dtype) for dtype, _, _ in reductions]
    return s_tir.Schedule(copy_attrs(grid.with_body(body).with_attr(ZEROED_INPUTS, workspace), func))
