"""Matmuls of a few rows (a decoding batch): the weight streamed once through `mma.sync`, operands swapped.

With 2-32 rows of X, the smallest wgmma tile (64 rows) wastes most of its work and gives too few
blocks to read the weight at bandwidth. Here the weight W [n, k] is the mma's A operand (16 of its
rows a warp) and X's rows its B operand (8 an mma; two tiles of them for up to 16 rows, four for up
to 32): C^T = W X^T. Each lane loads 16 bytes of two weight rows and of its X rows at the same k per
step of 32; the fragment layouts take them in registers once k is permuted within the step, the
same permutation for both operands, which leaves the sum unchanged. A block's warps split k and add
their sums in shared memory; the epilogue (cast, residual add, or a gated activation) follows. fp16
and bf16 on sm_80 and later. See docs/design.md#few-row-matmuls."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.script import tirx as T

from . import matmul
from .analysis import multiply_accumulate, size_of, substitute
from .contracts import GATE_RUN
from .wgmma_matmul import float32_contraction, fold_epilogue

NAME = "few_row_matmul"
ROW_CLASSES = (16, 32)  # the most rows of X a kernel serves (knob "rows"): 8 an mma tile
MAX_ROWS = ROW_CLASSES[-1]
WEIGHT_ROWS = 16  # a warp's rows of W: the mma's m16
STEP = 32  # k of one step: 4 lanes a row, 16 bytes each
VECTOR = 8  # elements of a lane's 16-byte load
WARPS = (4, 8)  # per block, each over its share of k
UNROLL = (2, 4, 8, 16)  # steps whose loads are issued before any is used
MANY_BLOCKS_PER_SM = 4  # blocks (16 weight rows each) per SM from which small blocks are resident all at once
LONG_K = 8192  # k from which a block of 4 warps keeps more loads in flight than one of 8
MMA_TYPES = {"float16": "fp16", "bfloat16": "bf16"}
MIN_SM = 80  # mma.sync m16n8k16 with fp32 accumulators


def weight_streaming_matmul(func: tirx.PrimFunc):
    """(matmul block, folded epilogue, m, n, k) of a `C[i, j] += X[i, k] * W[j, k]` (fp16/bf16,
    float32 C, n and k static, k a whole number of 16-byte loads, both operands read along k), else
    None: what this template and the GEMV template take, at their row counts. A gated epilogue reads
    C's columns in runs of GATE_RUN (contracts.gate_column): a block's 16 rows of W are 8 columns'
    gate and up rows."""
    found = float32_contraction(func)
    if found is None:
        return None
    sch, block, epilogue, _, extents = found
    if len(extents) != 3 or matmul.k_is_last(block) != (True, True):
        return None
    m, n, k = (size_of(e) for e in extents)
    if k % VECTOR:
        return None
    folded = fold_epilogue(sch, epilogue, block.writes[0].source, extents[:-1])
    return None if folded is None else (block, folded, m, n, k)


def _fit(func: tirx.PrimFunc):
    """weight_streaming_matmul(func) where m is at most MAX_ROWS or symbolic, else None."""
    found = weight_streaming_matmul(func)
    return None if found is None or isinstance(found[2], int) and found[2] > MAX_ROWS else found


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """Every (rows, warps, unroll) point, where the template fits: rows at least a static row count."""
    found = _fit(func)
    if found is None:
        return []
    m = found[2]
    return [{"strategy": NAME, "rows": r, "warps": w, "unroll": u}
            for r in ROW_CLASSES if not isinstance(m, int) or m <= r for w in WARPS for u in UNROLL]


def heuristic(func: tirx.PrimFunc, sm_count: int, rows: int | None = None) -> tuple[dict, s_tir.Schedule] | None:
    """The kernel for up to `rows` rows (a row class; a static row count takes the smallest class
    that holds it), with the knobs of `_knobs`."""
    found = _fit(func)
    if found is None:
        return None
    _, _, m, n, k = found
    limit = m if isinstance(m, int) else rows or ROW_CLASSES[0]
    served = next((r for r in ROW_CLASSES if limit <= r), None)
    if served is None:
        return None
    knobs = {"strategy": NAME, "rows": served, **_knobs(served, n, k, sm_count)}
    return knobs, s_tir.Schedule(func.with_body(_kernel(*found, served, knobs["warps"], knobs["unroll"])))


def _knobs(rows: int, n: int, k: int, sm_count: int) -> dict:
    """Warps and unroll, from H200 sweeps (docs/design.md#few-row-matmuls). Two tiles of X's rows:
    many blocks (a wide weight) want small blocks with few loads each, resident all at once; else
    16 steps in flight, 4 warps a block over a long k, 8 over a short one. Four tiles (twice the
    registers a step): 4 steps in flight, 2 over a long k."""
    if rows > ROW_CLASSES[0]:
        return {"warps": 8, "unroll": 2 if k >= LONG_K else 4}
    if -(-n // WEIGHT_ROWS) >= MANY_BLOCKS_PER_SM * sm_count:
        return {"warps": 4, "unroll": 2}
    return {"warps": 4 if k >= LONG_K else 8, "unroll": 16}


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    """The kernel for `func` with `knobs` (rows, warps, unroll) as a Schedule of the finished loop nest;
    None when it does not fit."""
    found = _fit(func)
    rows, warps, unroll = (int(knobs.get(x, 0)) for x in ("rows", "warps", "unroll"))
    if found is None or rows not in ROW_CLASSES or isinstance(found[2], int) and found[2] > rows \
            or warps not in WARPS or unroll not in UNROLL:
        return None
    return s_tir.Schedule(func.with_body(_kernel(*found, rows, warps, unroll)))


def operand_element(block, load, row, col, kk):
    """`load`'s element at the matmul `block`'s row, column and k."""
    typed = {iv.var: tirx.Cast(str(iv.var.ty), x) for iv, x in zip(block.iter_vars, (row, col, kk))}
    return load.source[tuple(substitute(index, typed) for index in load.indices)]


def stored_result(block, ep, row, col, *values):
    """What the output holds at (row, col) of the matmul `block` followed by the epilogue `ep`,
    given C's values it reads there (one; a gated epilogue: its gate's and its up projection's);
    and the output's indices."""
    if ep.ivs is None:
        return values[0], [tirx.Cast(str(iv.var.ty), x) for iv, x in zip(block.iter_vars, (row, col))]
    bindings = {var: tirx.Cast(str(var.ty), x) for var, x in zip(ep.ivs, (row, col))}
    return substitute(ep.value, {**bindings, **dict(zip(ep.loads, values))}), list(bindings.values())


def _kernel(block, ep, m, n, k, rows: int, warps: int, unroll: int) -> tirx.Stmt:
    """The loop nest, written against the original function's buffers."""
    x_load, w_load = multiply_accumulate(block.body)
    dtype = str(x_load.source.dtype)
    kind = MMA_TYPES[dtype]
    threads = warps * 32
    steps = -(-k // STEP)
    per_warp = -(-steps // warps)
    rounds = -(-per_warp // unroll)
    guarded = bool(per_warp * warps != steps or per_warp % unroll or k % STEP)  # some lanes' steps lie past k
    tiles = -(-min(m, rows) // 8) if isinstance(m, int) else rows // 8  # of X's rows, 8 an mma
    slot = 2 + tiles  # vectors a lane loads a step: W rows g and g + 8, X rows g + 8t
    rows_type = "int32" if isinstance(m, int) else str(m.ty)
    halves = len(ep.loads)  # C's values an output element reads: a gated one, its gate's and its up projection's
    columns = WEIGHT_ROWS // halves  # output columns of a block (gated: the weight rows g and g + GATE_RUN)
    out_n = columns * 8 * tiles  # output elements of a block: its columns x X's rows
    pitch = 8 * tiles + 1  # floats per weight row in shared memory: a padded row, reads free of bank conflicts

    def has_tile(t):
        """Whether X has rows in tile t (t >= 1): a run-time compare where m is symbolic. Its branches
        around a step's loads also keep ptxas from moving them next to their mmas, which left one step
        in flight (56 registers against 106 for 4096 x 4096; 14 us against 11)."""
        return m > tirx.Cast(rows_type, 8 * t)

    def mma(a_f, regs, acc, u, s, t):
        """C^T of X's row tile t += the step's k16 half s (A in a_f, B in slot u's vector of tile t)."""
        T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", kind, kind, "fp32", a_f.data, 0, regs.data,
                                    (u * slot + 2 + t) * VECTOR + s * 4, acc.data, 4 * t, False, dtype="float32"))

    def step_k(warp, i, u, q):
        """First k of lane q's 16 bytes in step (round i, slot u) of `warp`, held inside k."""
        kk = (warp * per_warp + i * unroll + u) * STEP + q * VECTOR
        return T.min(kk, k - VECTOR) if guarded else kk

    def step_valid(warp, i, u, q):
        """Whether lane q's 16 bytes in step (round i, slot u) of `warp` lie inside k and the warp's share."""
        return tirx.And(tirx.And(i * unroll + u < per_warp, warp * per_warp + i * unroll + u < steps),
                        (warp * per_warp + i * unroll + u) * STEP + q * VECTOR < k)

    @T.prim_func(check_well_formed=False)
    def kernel():
        bx = T.launch_thread("blockIdx.x", -(-n // WEIGHT_ROWS))
        tx = T.launch_thread("threadIdx.x", threads)
        # per slot: W rows g and g + 8, then X rows g + 8t; one buffer, so that the scalar reads of W's
        # keep its element type (a buffer read only in vectors is retyped, and the mma's offsets with it)
        regs = T.alloc_buffer((unroll * slot * VECTOR,), dtype, scope="local")
        a_f = T.alloc_buffer((8,), dtype, scope="local")
        acc = T.alloc_buffer((4 * tiles,), "float32", scope="local")  # C^T: a tile of 8 X rows each 4
        red = T.alloc_buffer((warps * WEIGHT_ROWS * pitch,), "float32", scope="shared")
        warp, g, q = T.meta_var((tx // 32, tx % 32 // 4, tx % 4))
        for r in T.unroll(4 * tiles):
            acc[r] = T.float32(0)
        for i in T.serial(rounds):
            for u in T.unroll(unroll):  # every load of the round first
                for half in T.unroll(2):
                    for e in T.vectorized(VECTOR):
                        regs[(u * slot + half) * VECTOR + e] = operand_element(
                            block, w_load, 0, T.min(bx * WEIGHT_ROWS + g + half * 8, n - 1), step_k(warp, i, u, q) + e)
                for e in T.vectorized(VECTOR):
                    regs[(u * slot + 2) * VECTOR + e] = operand_element(
                        block, x_load, T.min(g, m - 1), 0, step_k(warp, i, u, q) + e)
                for t in T.unroll(1, tiles):
                    if has_tile(t):  # see has_tile: this branch keeps the round's loads ahead of its mmas
                        for e in T.vectorized(VECTOR):
                            regs[(u * slot + 2 + t) * VECTOR + e] = operand_element(
                                block, x_load, T.min(g + 8 * t, m - 1), 0, step_k(warp, i, u, q) + e)
            for u in T.unroll(unroll):
                if guarded:  # a step past k adds nothing
                    for e in T.unroll(tiles * VECTOR):
                        regs[(u * slot + 2) * VECTOR + e] = T.if_then_else(step_valid(warp, i, u, q),
                                                                            regs[(u * slot + 2) * VECTOR + e], T.Cast(dtype, 0))
                for s in T.unroll(2):  # the step's two k16 mmas: lane q's k 8q + 4s .. 8q + 4s + 3
                    for r in T.unroll(8):  # A's registers: (row g, k 0-1), (g + 8, k 0-1), (g, k 2-3), (g + 8, k 2-3)
                        a_f[r] = regs[(u * slot + r // 2 % 2) * VECTOR + s * 4 + r // 4 * 2 + r % 2]
                    mma(a_f, regs, acc, u, s, 0)
                    for t in T.unroll(1, tiles):
                        if has_tile(t):
                            mma(a_f, regs, acc, u, s, t)
        for r in T.unroll(4 * tiles):  # C^T register r: weight row g (+ 8 for r % 4 >= 2), X row 8 (r // 4) + 2q + r % 2
            red[(warp * WEIGHT_ROWS + g + r % 4 // 2 * 8) * pitch + r // 4 * 8 + q * 2 + r % 2] = acc[r]
        T.tvm_storage_sync("shared")
        for e in T.unroll(-(-out_n // threads)):
            if e * threads + tx < out_n:
                for h in T.unroll(halves):
                    acc[h] = T.float32(0)
                    for w in T.unroll(warps):
                        acc[h] = acc[h] + red[(w * WEIGHT_ROWS + (e * threads + tx) % columns + h * GATE_RUN) * pitch
                                              + (e * threads + tx) // columns]
                row, col = T.meta_var(((e * threads + tx) // columns, bx * columns + (e * threads + tx) % columns))
                if tirx.Cast(rows_type, row) < m and col < n // halves:
                    value, indices = T.meta_var(stored_result(block, ep, row, col, *[acc[h] for h in range(halves)]))
                    T.buffer_store(ep.out, value, indices)

    return kernel.body
