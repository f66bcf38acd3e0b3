"""Attention of one query row per head over a long key/value cache (decoding), split over the keys.

One block per query row would leave most SMs idle at batch 1 and read the cache at a fraction of
the bandwidth. Here ("flash-decoding") the keys are cut into chunks; a block per (row, chunk) keeps
the softmax state of its chunk (maximum, sum, weighted values) and writes it to a float32
workspace, and a second kernel combines the chunks of each row, as a softmax's running maximum
and sum combine. CUDA cores: one query row against the keys is a matrix-vector product, bound by
reading K and V. Sizes may be symbolic (any batch and cache length). See docs/attention.md#decoding."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .attention import LOG2E, MASKED, Operand, operands
from .contracts import COPY_ELEMS

HEAD_DIMS = (64, 128, 256)  # head_dim / 8 lanes per key: a power of two within a warp
THREADS = 128
UNROLL = 4  # keys per lane group in flight: their K and V rows are loaded before any is used
MAX_SPLITS = 32  # chunks per row at most: the workspace's middle dim
MIN_CHUNK = 64  # keys per chunk at least, so that a block's loads outweigh its combining
BLOCKS_PER_SM = 4  # blocks aimed for, over the rows and their chunks


def fits(batch, seq_kv, dim: int, given: dict[str, Operand] | None = None) -> bool:
    """Whether `partial_kernel` takes these sizes (ints, or expressions of symbolic dims whose views
    the caller checked at sample sizes) and operand views: K and V rows read 16 bytes at a time."""
    if dim not in HEAD_DIMS:
        return False
    if not (isinstance(batch, int) and isinstance(seq_kv, int)):
        return True
    if batch <= 0 or seq_kv <= 0:
        return False
    views = operands(batch, 1, seq_kv, dim, given)
    return all(views[name][1].unit_stride_rows(-1, COPY_ELEMS) for name in ("q", "k", "v")) \
        and all(math.prod(shape) < 2**31 for shape, _ in views.values())


def splits(batch, seq_kv, sm_count: int):
    """Chunks per row: enough blocks for BLOCKS_PER_SM per SM, chunks of MIN_CHUNK keys at least,
    MAX_SPLITS at most (an int, or an expression of the symbolic sizes)."""
    target = BLOCKS_PER_SM * sm_count
    if isinstance(batch, int) and isinstance(seq_kv, int):
        return max(1, min(MAX_SPLITS, -(-target // batch), -(-seq_kv // MIN_CHUNK)))
    by_blocks = T.floordiv(batch + (target - 1), batch) if not isinstance(batch, int) else -(-target // batch)
    return T.max(1, T.min(T.min(MAX_SPLITS, by_blocks), T.floordiv(seq_kv + (MIN_CHUNK - 1), MIN_CHUNK)))


def workspace_shapes(batch, dim: int) -> tuple:
    """Each (row, chunk)'s weighted values [row, chunk, dim], and its maximum (log2 units) and sum
    [row, chunk, 2]."""
    return (batch, MAX_SPLITS, dim), (batch, MAX_SPLITS, 2)


def partial_kernel(batch, seq_kv, dim: int, scale: float, sm_count: int,
                   given: dict[str, Operand] | None = None, dtype: str = "float16") -> tirx.PrimFunc:
    """(q, k, v, values, max_sum): each (row, chunk) block's softmax state over its keys. `given` places
    q [batch, 1, dim], k and v [batch, seq_kv, dim] in other tensors (the cache, heads shared
    between query heads by a broadcast view)."""
    if not fits(batch, seq_kv, dim, given):
        raise ValueError(f"decode attention does not take batch={batch} keys={seq_kv} dim={dim}"
                         + (" and these operand views" if given else ""))
    views = operands(batch, 1, seq_kv, dim, given)
    (q_shape, q_at), (k_shape, k_at), (v_shape, v_at) = (
        (shape, view.element) for shape, view in (views[name] for name in ("q", "k", "v")))
    lanes = dim // COPY_ELEMS  # lanes per key row, 16 bytes each
    groups = THREADS // lanes  # keys a block reads at once
    n_splits = splits(batch, seq_kv, sm_count)
    chunk = (seq_kv + n_splits - 1) // n_splits
    steps = (chunk + groups * UNROLL - 1) // (groups * UNROLL)
    scale_log2 = float(scale) * LOG2E
    full = 0xFFFFFFFF

    @T.prim_func(check_well_formed=False)
    def partial(q_in: T.Buffer(q_shape, dtype), k_in: T.Buffer(k_shape, dtype), v_in: T.Buffer(v_shape, dtype),
                ws: T.Buffer(workspace_shapes(batch, dim)[0], "float32"), ml: T.Buffer(workspace_shapes(batch, dim)[1], "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.decl_buffer((math.prod(q_shape),), dtype, data=q_in.data)  # flat: indexed through the views
        k = T.decl_buffer((math.prod(k_shape),), dtype, data=k_in.data)
        v = T.decl_buffer((math.prod(v_shape),), dtype, data=v_in.data)
        bx = T.launch_thread("blockIdx.x", batch)  # rows fastest: the query heads of one cache head run together
        by = T.launch_thread("blockIdx.y", n_splits)
        tx = T.launch_thread("threadIdx.x", THREADS)
        q_f = T.alloc_buffer((COPY_ELEMS,), "float32", scope="local")
        k_r = T.alloc_buffer((UNROLL * COPY_ELEMS,), dtype, scope="local")
        v_r = T.alloc_buffer((UNROLL * COPY_ELEMS,), dtype, scope="local")
        s = T.alloc_buffer((UNROLL,), "float32", scope="local")
        acc = T.alloc_buffer((COPY_ELEMS,), "float32", scope="local")
        state = T.alloc_buffer((3,), "float32", scope="local")  # running maximum, sum, and the rescale
        o_sh = T.alloc_buffer((groups * dim,), "float32", scope="shared")
        ml_sh = T.alloc_buffer((2 * groups,), "float32", scope="shared")
        g = T.meta_var(tx // lanes)
        col = T.meta_var(tx % lanes * COPY_ELEMS)
        start = T.meta_var(by * chunk)
        end = T.meta_var(T.min(start + chunk, seq_kv))
        for e in T.unroll(COPY_ELEMS):
            q_f[e] = T.Cast("float32", q[q_at(bx, 0, col + e)]) * T.float32(scale_log2)
            acc[e] = T.float32(0)
        state[0] = T.float32(MASKED)
        state[1] = T.float32(0)
        for i in T.serial(steps):
            for u in T.unroll(UNROLL):  # every load first: UNROLL rows of K and V in flight
                key = T.meta_var(T.min(start + (i * UNROLL + u) * groups + g, seq_kv - 1))
                for e in T.vectorized(COPY_ELEMS):
                    k_r[u * COPY_ELEMS + e] = k[k_at(bx, key, col + e)]
                for e in T.vectorized(COPY_ELEMS):
                    v_r[u * COPY_ELEMS + e] = v[v_at(bx, key, col + e)]
            for u in T.unroll(UNROLL):
                s[u] = T.float32(0)
                for e in T.unroll(COPY_ELEMS):
                    s[u] = s[u] + q_f[e] * T.Cast("float32", k_r[u * COPY_ELEMS + e])
                for step in T.unroll(int(math.log2(lanes))):  # the row's dot product over its lanes
                    s[u] = s[u] + T.tvm_warp_shuffle_xor(full, s[u], 1 << step, 32, 32)
                s[u] = T.if_then_else(start + (i * UNROLL + u) * groups + g < end, s[u], T.float32(MASKED))
            state[2] = state[0]
            for u in T.unroll(UNROLL):
                state[0] = T.max(state[0], s[u])
            state[2] = T.exp2(state[2] - state[0])  # the old state's weight under the new maximum
            state[1] = state[1] * state[2]
            for e in T.unroll(COPY_ELEMS):
                acc[e] = acc[e] * state[2]
            for u in T.unroll(UNROLL):  # a key past the chunk weighs 0, even while no key of this lane group is real yet
                s[u] = T.if_then_else(s[u] == T.float32(MASKED), T.float32(0), T.exp2(s[u] - state[0]))
                state[1] = state[1] + s[u]
                for e in T.unroll(COPY_ELEMS):
                    acc[e] = acc[e] + s[u] * T.Cast("float32", v_r[u * COPY_ELEMS + e])
        for e in T.unroll(COPY_ELEMS):
            o_sh[g * dim + col + e] = acc[e]
        if tx % lanes == 0:
            ml_sh[g] = state[0]
            ml_sh[groups + g] = state[1]
        T.tvm_storage_sync("shared")
        for c in T.serial((dim + THREADS - 1) // THREADS):  # the lane groups' states combined, a column a thread
            if c * THREADS + tx < dim:
                state[0] = T.float32(MASKED)
                for j in T.serial(groups):
                    state[0] = T.max(state[0], ml_sh[j])
                state[1] = T.float32(0)
                state[2] = T.float32(0)
                for j in T.serial(groups):
                    state[1] = state[1] + ml_sh[groups + j] * T.exp2(ml_sh[j] - state[0])
                    state[2] = state[2] + o_sh[j * dim + c * THREADS + tx] * T.exp2(ml_sh[j] - state[0])
                ws[bx, by, c * THREADS + tx] = state[2]
                if c * THREADS + tx == 0:
                    ml[bx, by, 0] = state[0]
                    ml[bx, by, 1] = state[1]

    return partial


def combine_kernel(batch, seq_kv, dim: int, sm_count: int, out: Operand | None = None,
                   dtype: str = "float16") -> tirx.PrimFunc:
    """(values, max_sum, out): each row's chunks combined, divided by the sum, written through the `out`
    view (tensor shape, view of [batch, 1, dim]; default contiguous)."""
    out_shape, out_view = out or operands(batch, 1, seq_kv, dim)["out"]
    out_at = out_view.element
    n_splits = splits(batch, seq_kv, sm_count)

    @T.prim_func(check_well_formed=False)
    def combine(ws: T.Buffer(workspace_shapes(batch, dim)[0], "float32"), ml: T.Buffer(workspace_shapes(batch, dim)[1], "float32"),
                out_in: T.Buffer(out_shape, dtype)):
        T.func_attr({"tirx.noalias": True})
        o = T.decl_buffer((math.prod(out_shape),), dtype, data=out_in.data)
        bx = T.launch_thread("blockIdx.x", batch)
        tx = T.launch_thread("threadIdx.x", dim)
        state = T.alloc_buffer((3,), "float32", scope="local")  # maximum, sum, weighted values
        state[0] = T.float32(MASKED)
        for j in T.serial(n_splits):
            state[0] = T.max(state[0], ml[bx, j, 0])
        state[1] = T.float32(0)
        state[2] = T.float32(0)
        for j in T.serial(n_splits):
            state[1] = state[1] + ml[bx, j, 1] * T.exp2(ml[bx, j, 0] - state[0])
            state[2] = state[2] + ws[bx, j, tx] * T.exp2(ml[bx, j, 0] - state[0])
        o[out_at(bx, 0, tx)] = T.Cast(dtype, state[2] / state[1])

    return combine


def with_scalar_dims(func: tirx.PrimFunc, outputs: int = 1) -> tuple[tirx.PrimFunc, list]:
    """(func taking the symbolic dims that no buffer's shape gives bare as scalars, after its inputs
    and before its `outputs` (as FuseTIR passes them), those dims in order)."""
    inputs, outputs = func.params[:-outputs], func.params[-outputs:]
    shapes = [p.shape for p in func.params]
    bare = {d for shape in shapes for d in shape if isinstance(d, tirx.Var)}
    used = {str(v): v for shape in shapes for d in shape for v in tirx.analysis.undefined_vars(d, [])}
    used.update({str(v): v for v in tirx.analysis.undefined_vars(func.body, [])
                 if not any(v.same_as(p) for p in func.params) and str(v.ty).startswith("int")})
    dims = [v for _, v in sorted(used.items()) if v not in bare]
    return tirx.PrimFunc([*inputs, *dims, *outputs], func.body, func.ret_type, func.attrs), dims
