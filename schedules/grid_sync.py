"""GPU strategy for few, huge rows whose reductions feed work on every element (RMSNorm, softmax).

One cooperative launch; per reduction, blocks publish partials, meet at a grid barrier and each
combines its row's partials, so later reductions and the epilogue run in the same kernel. Needs
every block resident: grids are sized to half the SM's thread slots (up to 64 registers a thread)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .analysis import ROW, ReducePattern, const_int
from .device import Device
from . import reducers
from .contracts import GRID_SYNC, ZEROED_INPUTS, extern_name
from .grid_reduce import (COMBINERS, MIN_ROW, buffer_decl, combiner_parts, copy_attrs,
                          grid_split, map_vars, row_element_vars)
from .rows import MAX_EPILOGUE_LANES, vector_choices, vector_lanes

NAME = "grid_sync"
THREADS = 512


def cooperative_slots(device: Device, threads: int) -> int:
    """Blocks of `threads` a cooperative grid may hold: half the SM thread slots (<= 64 registers/thread)."""
    return device.sm_count * max(1, device.threads_per_sm // 2 // threads)


@dataclass
class _Reduction:
    """One reduction of the chain: its block, state dtypes and identities, and how to merge."""

    block: object
    dtypes: list
    identities: list  # one TVMScript literal per state value
    combiner: str | None = None  # "+", "max" or "min" for a single value ...
    value: object = None  # ... with the per-element value it folds in
    combine: Callable | None = None  # or the registered merge rule of a multi-value state

    @property
    def outputs(self):
        return [w.source for w in self.block.writes]


def _reduction(block) -> _Reduction | None:
    dtypes = [str(w.source.ty.dtype) for w in block.writes]
    if len(dtypes) == 1:
        parts = combiner_parts(block)
        return None if parts is None else _Reduction(block, dtypes, [parts[2].script()], COMBINERS[parts[0]], parts[1])
    rule = reducers.of(block)
    if rule is None:
        return None
    combine, identity = rule
    return _Reduction(block, dtypes, [e.script() for e in identity(*dtypes)], combine=combine)


def _chain(pattern: ReducePattern):
    """([_Reduction] of the reductions, the epilogue block), or None.

    The epilogue works on every element ([row, reduce dims...]) or writes one value per row (a
    variance: after the last barrier, the row's first block writes it)."""
    if pattern.num_spatial != 1 or pattern.row_outputs or pattern.epilogue is None:
        return None
    epilogue = pattern.sch.get(pattern.epilogue.block_rv)
    chain = [_reduction(pattern.sch.get(info.block_rv)) for info in pattern.reductions]
    if any(r is None for r in chain):
        return None
    # the epilogue must walk [row, reduce dims...] in the reductions' order: we map its vars that way
    row_dims = [int(iv.dom.extent) for iv in chain[0].block.iter_vars]
    if [const_int(iv.dom.extent) for iv in epilogue.iter_vars] not in (row_dims, row_dims[:1]):
        return None
    return chain, epilogue


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    rows, width = const_int(pattern.row_count), const_int(pattern.reduce_extent)
    if not device.is_gpu or pattern.layout != ROW or rows is None or width is None or _chain(pattern) is None:
        return None
    if pattern.epilogue is not None and not pattern.epilogue.iters:
        return None  # one value out (a whole tensor's mean): no element waits for it, grid_reduce's ticket does
    slots = cooperative_slots(device, THREADS)
    if width < MIN_ROW or rows * 2 > slots:
        return None  # rows enough to fill the GPU one block each: a row-per-block schedule needs no barrier
    return {"strategy": NAME, "blocks_per_row": slots // rows, "threads": THREADS, "vec": vector_lanes(pattern)}


def _template(func, chain, rows, blocks, threads, vec, chunk, width, staged, per_row, workspace) -> str:
    """The kernel as TVMScript; call_extern placeholders stand for the spliced values and epilogue.

    Placeholders get (row, position in the row, block, position in the block's chunk). With
    `staged` (an input's name), the block first copies its chunk of that input into shared memory
    in 16-byte pieces, so HBM sees it once however many passes read it. State value c of
    reduction i lives in gs_part{i}_{c} (this block's), a slice of the workspace gs_ws_<dtype>
    (every block's, in global memory; `workspace` is _workspace's answer) and gs_tot{i}_{c} (the row's).
    """
    n_in, B, G = len(func.params) - 1, rows * blocks, blocks
    i64 = lambda v: f"T.int64({v})"  # noqa: E731
    G_, B_, T_ = i64(G), i64(B), i64(threads)
    states = [(i, c, dtype) for i, r in enumerate(chain) for c, dtype in enumerate(r.dtypes)]
    params = [f"{p.name}: {buffer_decl(p)}" for p in func.params[:n_in]]
    slots, sizes = workspace
    params += [f'gs_ws_{dtype}: T.Buffer(({i64(size)},), "{dtype}")' for dtype, size in sizes.items()]

    def partial(i, c, index):
        dtype, offset = slots[(i, c)]
        return f"gs_ws_{dtype}[{i64(offset)} + {index}]"

    params.append(f"{func.params[-1].name}: {buffer_decl(func.params[-1])}")
    inputs = [f"{p.name}[{', '.join(f'0:{int(d)}' for d in p.shape)}]" for p in func.params[:n_in]]
    inputs += [f"gs_x[0:{i64(chunk)}]"] if staged else []
    tail = chunk * blocks != width
    lines = ["@T.prim_func(s_tir=True)", f"def grid_sync({', '.join(params)}):"]
    lines += [f'    gs_{kind}{i}_{c} = T.sblock_alloc_buffer(({B_},), "{dtype}", scope="shared")'
              for i, c, dtype in states for kind in ("tot", "part")]
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
    for i, r in enumerate(chain):
        own = range(len(r.dtypes))
        part, tot = ", ".join(f"gs_part{i}_{c}[vb]" for c in own), ", ".join(f"gs_tot{i}_{c}[vb]" for c in own)
        earlier = "".join(f", gs_tot{j}_{c}[vb]" for j in range(i) for c in range(len(chain[j].dtypes)))
        partials = ", ".join(partial(i, c, f"vb // {G_} * {G_} + vj") for c in own)
        position = f"vb // {G_}, vb % {G_} * {i64(chunk)} + vk, vb, vk"
        if r.combine is None:
            acc = (lambda x, y: f"{x} + {y}") if r.combiner == "+" else (lambda x, y, c=r.combiner: f"T.{c}({x}, {y})")
            dtype = r.dtypes[0]
            value = f'T.call_extern("{dtype}", "gs_value{i}", {position})'
            update = f"gs_part{i}_0[vb] = {acc(f'gs_part{i}_0[vb]', value)}"
            other = f'T.call_extern("{dtype}", "__ldcg", T.address_of({partial(i, 0, f"vb // {G_} * {G_} + vj")}))'
            merge = f"gs_tot{i}_0[vb] = {acc(f'gs_tot{i}_0[vb]', other)}"
        else:  # the block's own update and the registered merge rule are spliced in
            update = f'T.evaluate(T.call_extern("void", "gs_update{i}", {position}))'
            merge = f'T.evaluate(T.call_extern("void", "gs_merge{i}", vb, vj))'
        inits = "; ".join(f"gs_part{i}_{c}[vb] = {r.identities[c]}" for c in own)
        tot_inits = "; ".join(f"gs_tot{i}_{c}[vb] = {r.identities[c]}" for c in own)
        publish = "; ".join(f"{partial(i, c, 'vb')} = gs_part{i}_{c}[vb]" for c in own)
        # consecutive threads take consecutive elements: coalesced in HBM, conflict-free in shared memory
        lines.append(f'''
        for tx in T.thread_binding({T_}, thread="threadIdx.x"):
            for o in range({i64(chunk // (threads * vec))}):
                for v in T.unroll({i64(vec)}):
                    with T.sblock("gs_chunk{i}"):
                        vb = T.axis.spatial({B_}, bx)
                        vk = T.axis.reduce({i64(chunk)}, (o * {i64(vec)} + v) * {T_} + tx)
                        T.reads({", ".join(inputs)}{earlier}, {part})
                        T.writes({part})
                        with T.init():
                            {inits}
                        {update}
        for tx in T.thread_binding({T_}, thread="threadIdx.x"):
            with T.sblock("gs_publish{i}"):
                vb = T.axis.spatial({B_}, bx)
                vt = T.axis.spatial({T_}, tx)
                T.reads({part})
                T.writes({", ".join(partial(i, c, "vb") for c in own)})
                if vt == T.int64(0):
                    {publish}
                    T.evaluate(T.call_extern("void", "__threadfence"))
                T.evaluate(T.call_extern("void", "{GRID_SYNC}"))
        for j in range({i64(-(-blocks // threads))}):
            for tx in T.thread_binding({T_}, thread="threadIdx.x"):
                with T.sblock("gs_total{i}"):
                    vb = T.axis.spatial({B_}, bx)
                    vj = T.axis.reduce({i64(-(-blocks // threads) * threads)}, j * {T_} + tx)
                    T.where(j * {T_} + tx < {G_})
                    T.reads({partials}, {tot})
                    T.writes({tot})
                    with T.init():
                        {tot_inits}
                    {merge}''')
    out = func.params[-1]
    totals = "".join(f", gs_tot{i}_{c}[vb]" for i, c, _ in states)
    if per_row:
        lines.append(f'''
        for tx in T.thread_binding({T_}, thread="threadIdx.x"):
            with T.sblock("gs_epilogue"):
                vb = T.axis.spatial({B_}, bx)
                vt = T.axis.spatial({T_}, tx)
                T.where(bx % {G_} == T.int64(0) and tx == T.int64(0))
                T.reads({", ".join(inputs)}{totals})
                T.writes({out.name}[{", ".join(f"0:{int(d)}" for d in out.shape)}])
                T.evaluate(T.call_extern("void", "gs_epilogue", vb // {G_}, T.int64(0), vb, T.int64(0)))''')
        return "\n".join(lines) + "\n"
    lanes = 1 if tail else min(vec, MAX_EPILOGUE_LANES)
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


def _workspace(chain, blocks: int):
    """Where every block's partial states live: ({(reduction, value): (dtype, offset)}, {dtype: size}).

    One buffer per dtype, each state value a slice of it: the pipeline passes these buffers as
    zero-filled constants, and the VM shares equal constants, so separate same-sized buffers
    of one dtype would be one memory (seen: LayerNorm's three Welford values overwrote each other).
    """
    slots, sizes = {}, {}
    for i, r in enumerate(chain):
        for c, dtype in enumerate(r.dtypes):
            slots[(i, c)] = (dtype, sizes.get(dtype, 0))
            sizes[dtype] = sizes.get(dtype, 0) + blocks
    return slots, sizes


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


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every co-resident point where the heuristic would consider a cooperative grid: 256..1024
    threads, 2.. blocks per row (powers of two and the heuristic's; the whole grid within the
    cooperative slots), each vector width dividing the row, the row's chunk staged or not."""
    chosen = default_knobs(pattern, device)
    if chosen is None:
        return []
    rows = const_int(pattern.row_count)
    return [{"strategy": NAME, "blocks_per_row": blocks, "threads": threads, "vec": vec, "cache": cache}
            for threads in (256, 512, 1024)
            for blocks in sorted({2, 4, 8, 16, 32, 64, 128, chosen["blocks_per_row"]})
            if rows * blocks <= cooperative_slots(device, threads)
            for vec in vector_choices(pattern) for cache in (True, False)]


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    found, split = _chain(pattern), grid_split(pattern, device, knobs)
    if found is None or split is None:
        return None
    chain, epilogue = found
    rows, width, blocks, threads, vec, chunk = split
    if rows * blocks > cooperative_slots(device, threads):
        return None  # not co-resident: the cooperative launch would be refused
    if chunk * blocks != width and any(r.combine is not None for r in chain):
        return None  # a multi-value state cannot mask the overhang of the last chunk with an identity
    func = pattern.sch.mod["main"]
    staged = _staged_input(pattern, chunk, device) if knobs.get("cache", True) else None
    per_row = len(epilogue.iter_vars) == 1
    slots, sizes = _workspace(chain, rows * blocks)
    grid = tvm.script.from_source(_template(func, chain, rows, blocks, threads, vec, chunk, width, staged, per_row,
                                            (slots, sizes)))

    buffers = dict(zip(func.params, list(grid.params[:len(func.params) - 1]) + [grid.params[-1]]))
    local = {}
    tvm_ffi.structural_walk(grid.body, (s_tir.SBlock, lambda b: local.update(
        {buf.name: buf for buf in b.alloc_buffers})), order="pre")
    workspace = {p.name: p for p in grid.params if p.name.startswith("gs_ws_")}

    def state_loads(e, kind, i, vb):
        """A load of reduction i's state value c, as gs_{kind}{i}_{c}[vb]; None for other loads."""
        for c, out in enumerate(chain[i].outputs):
            if e.source.same_as(out):
                return tirx.BufferLoad(local[f"gs_{kind}{i}_{c}"], [vb])
        return None

    def resolve(expr, block, row, k, vb, ve, own=None):
        """`expr` of `block` at (row, k): inputs renamed, the staged one read from shared memory,
        earlier reductions read from their totals, reduction `own`'s state from this block's part."""
        elements = [iv for iv in block.iter_vars]

        def is_element(index, iv) -> bool:  # the block's own var, or 0 on a unit axis (a single row)
            return index.same_as(iv.var) or (const_int(iv.dom.extent) == 1 and const_int(index) == 0)

        def load(e):
            if own is not None and (part := state_loads(e, "part", own, vb)) is not None:
                return part
            for i in range(len(chain)):
                if (total := state_loads(e, "tot", i, vb)) is not None:
                    return total
            at_element = len(e.indices) == len(elements) and all(is_element(i, v) for i, v in zip(e.indices, elements))
            if staged and e.source.name == staged and at_element:
                return tirx.BufferLoad(local["gs_x"], [ve])
            return e

        expr = tvm_ffi.structural_map(expr, (tvm.ir.TensorLoad, load))
        return map_vars(expr, {**buffers, **row_element_vars(block, row, k)})

    def index_of(name: str, prefix: str) -> int:
        return int(name.removeprefix(prefix))

    def splice_value(call):
        r = chain[index_of(call.args[0].value, "gs_value")]
        row, k, vb, ve = call.args[1:5]
        spliced = resolve(r.value, r.block, row, k, vb, ve)
        # a predicate (T.where) on a reduction block that mentions blockIdx stops TVM's
        # cross-thread lowering, so the last block's overhang is masked in the value instead
        return spliced if chunk * blocks == width else tirx.if_then_else(k < width, spliced, r.block.init.value)

    def splice_update(i, args):
        """The block's own update (Binds, then stores), on this block's part of the state."""
        r = chain[i]
        row, k, vb, ve = args

        def stmt(st):
            if isinstance(st, tirx.Bind):
                return tirx.Bind(st.var, resolve(st.value, r.block, row, k, vb, ve, own=i))
            c = [j for j, out in enumerate(r.outputs) if out.same_as(st.buffer)][0]
            return tirx.BufferStore(local[f"gs_part{i}_{c}"], resolve(st.value, r.block, row, k, vb, ve, own=i), [vb])

        return tirx.SeqStmt([stmt(st) for st in r.block.body.seq])

    def splice_merge(i, vb, vj):
        """gs_tot = combine(gs_tot, partial of block vj of the row), in the form TVM matches reducers by."""
        r, G = chain[i], tirx.const(blocks, "int64")
        mine = [tirx.BufferLoad(local[f"gs_tot{i}_{c}"], [vb]) for c in range(len(r.dtypes))]
        other = [tirx.call_extern(dtype, "__ldcg", tirx.address_of(tirx.BufferLoad(
            workspace[f"gs_ws_{dtype}"], [tirx.const(slots[(i, c)][1], "int64") + vb // G * G + vj])))
            for c, dtype in enumerate(r.dtypes)]
        merged = r.combine(mine, other)
        names = [tirx.Var(f"gs_merged{i}_{c}", dtype) for c, dtype in enumerate(r.dtypes)]
        return tirx.SeqStmt([tirx.Bind(v, e) for v, e in zip(names, merged)]
                            + [tirx.BufferStore(local[f"gs_tot{i}_{c}"], v, [vb]) for c, v in enumerate(names)])

    def splice_epilogue(stmt):
        row, k, vb, ve = stmt.value.args[1:5]
        store = epilogue.body
        return tirx.BufferStore(buffers.get(store.buffer, store.buffer), resolve(store.value, epilogue, row, k, vb, ve),
                                [map_vars(i, row_element_vars(epilogue, row, k)) for i in store.indices])

    def splice_statement(st):
        name = extern_name(st.value) or ""
        if name == "gs_epilogue":
            return splice_epilogue(st)
        if name.startswith("gs_update"):
            return splice_update(index_of(name, "gs_update"), st.value.args[1:5])
        if name.startswith("gs_merge"):
            return splice_merge(index_of(name, "gs_merge"), *st.value.args[1:3])
        return st

    body = tvm_ffi.structural_map(grid.body, [
        (tvm.ir.Call, lambda e: splice_value(e) if (extern_name(e) or "").startswith("gs_value") else e),
        (tirx.Evaluate, splice_statement),
    ])
    zeroed = [([size], dtype) for dtype, size in sizes.items()]
    return s_tir.Schedule(copy_attrs(grid.with_body(body).with_attr(ZEROED_INPUTS, zeroed), func))
