"""One row of X against a weight W [n, k] as stored (a decoding step's matmul): a GEMV at the
weight's streaming bandwidth.

The time is the weight's reading. A group of `split` warps takes `rows` consecutive rows of W, its
warps in turn along k: each lane loads 16 bytes of every row a step, `unroll` steps issued before
any is used, and X's 16 bytes at the same k serve all of the rows. Products add in float32 per
lane, then over the warp by shuffles and over the group in shared memory; the epilogue (cast,
bias, residual) follows. A gated epilogue's group takes rows in pairs, a column's gate and up
rows of W (contracts.gate_column). fp16 and bf16, any CUDA GPU. See docs/design.md#gemv."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.script import tirx as T

from .analysis import multiply_accumulate
from .contracts import gate_column
from .few_row_matmul import VECTOR, operand_element, stored_result, weight_streaming_matmul

NAME = "gemv"
ROWS = (1, 2, 4)  # rows of W a group of warps sums
WARPS = (4, 8)  # per block
SPLIT = (1, 2, 4)  # warps of a block that share rows, each a part of k
UNROLL = (2, 4, 8)  # steps whose loads are issued before any is used
KNOBS = ("rows", "warps", "split", "unroll")
LONG_K = 8192  # k from which a warp takes 4 rows
MANY_BLOCKS_PER_SM = 8  # blocks (one row group each) an SM from which 2 rows a warp still leave every SM busy


def _fit(func: tirx.PrimFunc):
    """(matmul block, folded epilogue, n, k) of a `C[0, j] += X[0, k] * W[j, k]` this template takes
    (few_row_matmul.weight_streaming_matmul at one row), else None."""
    found = weight_streaming_matmul(func)
    return None if found is None or found[2] != 1 else (found[0], found[1], *found[3:])


def fits(func: tirx.PrimFunc) -> bool:
    """Whether the template takes `func`."""
    return _fit(func) is not None


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """Every (rows, warps, split, unroll) point where the template fits (gated: rows in pairs)."""
    found = _fit(func)
    if found is None:
        return []
    return [{"strategy": NAME, "rows": r, "warps": w, "split": s, "unroll": u}
            for r in ROWS if r % len(found[1].loads) == 0 for w in WARPS for s in SPLIT for u in UNROLL]


def heuristic(func: tirx.PrimFunc, sm_count: int) -> tuple[dict, s_tir.Schedule] | None:
    """The kernel with the knobs of `_knobs`, or None where the template does not fit."""
    found = _fit(func)
    if found is None:
        return None
    knobs = {"strategy": NAME, **_knobs(*found[2:], sm_count, pairs=found[1].gated)}
    return knobs, s_tir.Schedule(func.with_body(_kernel(*found, *(knobs[x] for x in KNOBS))))


def _knobs(n: int, k: int, sm_count: int, pairs: bool = False) -> dict:
    """From an H200 sweep (docs/design.md#gemv): a block of 4 warps over k, each 4 steps in flight
    for 2 rows; 4 rows over a long k; 1 row (8 steps) where 2 would leave fewer than 8 blocks an SM
    (`pairs`: rows of a gated epilogue, at least 2)."""
    rows = 4 if k >= LONG_K else 2 if pairs or n >= 2 * MANY_BLOCKS_PER_SM * sm_count else 1
    return {"rows": rows, "warps": 4, "split": 4, "unroll": 8 if rows == 1 else 4}


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    """The kernel for `func` with `knobs` (rows, warps, split, unroll); None when it does not fit."""
    found = _fit(func)
    values = [int(knobs.get(x, 0)) for x in KNOBS]
    if found is None or any(v not in space for v, space in zip(values, (ROWS, WARPS, SPLIT, UNROLL))) \
            or values[0] % len(found[1].loads):
        return None
    return s_tir.Schedule(func.with_body(_kernel(*found, *values)))


def _kernel(block, ep, n: int, k: int, rows: int, warps: int, split: int, unroll: int) -> tirx.Stmt:
    """The loop nest, written against the original function's buffers."""
    x_load, w_load = multiply_accumulate(block.body)
    dtype = str(x_load.source.dtype)
    lanes = 32 * split  # of a row group: its warps take turns along k, 16 bytes a lane
    groups = warps // split  # row groups of a block
    vectors = k // VECTOR
    rounds = -(-vectors // (lanes * unroll))
    guarded = rounds * unroll * lanes != vectors  # some lanes' steps lie past k
    full = 0xFFFFFFFF
    halves = len(ep.loads)  # C's values an output element reads: a gated one, its gate's and its up projection's
    outs = rows // halves  # output elements of a row group

    def w_row(p):
        """W's row for the group's row p: gated, rows in pairs (a column's gate, then its up)."""
        return gate_column(p // 2, p % 2) if halves == 2 else p

    def slot_of(i, u, lane):
        """The 16-byte vector of k a lane (0 .. lanes - 1 in its group) loads in step (round i, slot u)."""
        return (i * unroll + u) * lanes + lane

    def step_k(i, u, lane):
        """First k of the lane's 16 bytes in step (round i, slot u), held inside k."""
        v = slot_of(i, u, lane)
        return T.min(v, vectors - 1) * VECTOR if guarded else v * VECTOR

    @T.prim_func(check_well_formed=False)
    def kernel():
        bx = T.launch_thread("blockIdx.x", -(-n // (groups * rows)))
        tx = T.launch_thread("threadIdx.x", warps * 32)
        w = T.alloc_buffer((unroll * rows * VECTOR,), dtype, scope="local")
        x = T.alloc_buffer((unroll * VECTOR,), dtype, scope="local")
        acc = T.alloc_buffer((rows,), "float32", scope="local")
        red = T.alloc_buffer((warps * rows,), "float32", scope="shared")
        row0, lane = T.meta_var(((bx * groups + tx // lanes) * rows, tx % lanes))
        for r in T.unroll(rows):
            acc[r] = T.float32(0)
        for i in T.serial(rounds):
            for u in T.unroll(unroll):  # every load of the round first
                for e in T.vectorized(VECTOR):
                    x[u * VECTOR + e] = operand_element(block, x_load, 0, 0, step_k(i, u, lane) + e)
                for r in T.unroll(rows):
                    for e in T.vectorized(VECTOR):
                        w[(u * rows + r) * VECTOR + e] = operand_element(
                            block, w_load, 0, w_row(T.min(row0 + r, n - 1)), step_k(i, u, lane) + e)
            for u in T.unroll(unroll):
                if guarded:  # a step past k adds nothing
                    for e in T.unroll(VECTOR):
                        x[u * VECTOR + e] = T.if_then_else(slot_of(i, u, lane) < vectors, x[u * VECTOR + e], T.Cast(dtype, 0))
                for r in T.unroll(rows):
                    for e in T.unroll(VECTOR):
                        acc[r] = acc[r] + T.Cast("float32", x[u * VECTOR + e]) * T.Cast("float32", w[(u * rows + r) * VECTOR + e])
        for r in T.unroll(rows):
            for s in T.unroll(5):
                acc[r] = acc[r] + T.tvm_warp_shuffle_xor(full, acc[r], 16 >> s, 32, 32)
        if split > 1:  # the group's warps add their sums in shared memory
            for r in T.unroll(rows):
                if tx % 32 == r:
                    red[tx // 32 * rows + r] = acc[r]
            T.tvm_storage_sync("shared")
            if tx < groups * outs:
                for h in T.unroll(halves):
                    acc[h] = T.float32(0)
                    for p in T.unroll(split):
                        acc[h] = acc[h] + red[(tx // outs * split + p) * rows + tx % outs * halves + h]
                if bx * groups * outs + tx < n // halves:
                    value, indices = T.meta_var(stored_result(block, ep, 0, bx * groups * outs + tx,
                                                              *[acc[h] for h in range(halves)]))
                    T.buffer_store(ep.out, value, indices)
        else:
            for r in T.unroll(outs):
                if lane == r and row0 // halves + r < n // halves:
                    value, indices = T.meta_var(stored_result(block, ep, 0, row0 // halves + r,
                                                              *[acc[r * halves + h] for h in range(halves)]))
                    T.buffer_store(ep.out, value, indices)

    return kernel.body
