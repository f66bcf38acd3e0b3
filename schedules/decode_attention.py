"""Attention of one query row per head over a long key/value cache (decoding), split over the keys.

One block per query row would leave most SMs idle at batch 1 and read the cache at a fraction of
the bandwidth. Here ("flash-decoding") the keys are cut into chunks; a block per (row, chunk) keeps
the softmax state of its chunk (maximum, sum, weighted values) and writes it to a float32
workspace, and a second kernel combines the chunks of each row, as a softmax's running maximum
and sum combine. A cache grown by this step's rows (concatenated along the keys) is read in its
two parts and written by the blocks as they read it. CUDA cores: one query row against the keys is
a matrix-vector product, bound by reading K and V. Sizes may be symbolic (any batch and cache length). See docs/attention.md#decoding."""

from __future__ import annotations

import functools
import math

from tvm import s_tir, tirx
from tvm.script import tirx as T

from .attention import LOG2E, MASKED, Operand, decoded, encoded, operands, sized
from .contracts import COPY_ELEMS

HEAD_DIMS = (64, 128, 256)  # head_dim / 8 lanes per key: a power of two within a warp
THREADS = 128
UNROLL = 4  # keys per lane group in flight: their K and V rows are loaded before any is used
MAX_SPLITS = 32  # chunks per row at most: the workspace's middle dim
MIN_CHUNK = 64  # keys per chunk at least, so that a block's loads outweigh its combining
BLOCKS_PER_SM = 4  # blocks aimed for, over the rows and their chunks


# A tuning task: the partial kernel is written at DEFAULT_KNOBS before dispatch, carrying the arguments
# it was made from (RECIPE), so that the dispatcher can make it again at another point of KNOB_SPACE.
# No knob moves the chunks (splits): the combine kernel and the workspace keep their meaning.
NAME = "decode_attention"
RECIPE = "tvm_ext.decode_attention_recipe"
KNOB_SPACE = {"threads": (64, 128, 256), "unroll": (2, 4, 8)}
DEFAULT_KNOBS = {"strategy": NAME, "threads": THREADS, "unroll": UNROLL}


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


class _Grown:
    """K or V read from the cache before this step and the new rows (`past`, `new`: contiguous
    tensor shapes, concatenated along `axis`), and written whole through the operand's view (of the
    concatenation: the grown cache), so that no copy kernel reads the cache once more."""

    def __init__(self, view, given: dict[str, Operand], name: str, axis: int):
        past, new = given[f"{name}_past"][0], given[f"{name}_new"][0]
        self.past_shape, self.new_shape = past, new
        self.past_len, self.new_len, self.inner = past[axis], new[axis], math.prod(past[axis + 1:])
        self.view = view

    def bases(self, row, col) -> tuple:
        """(offset in the past tensor, in the new one) of key 0 of (row, col): the element's
        place in the concatenation split into what lies outside and inside the concatenated axis."""
        at = self.view.element(row, 0, col)
        grown_len = self.past_len + self.new_len
        outer, inner = at // (grown_len * self.inner), at % self.inner
        return outer * self.past_len * self.inner + inner, outer * self.new_len * self.inner + inner

    def writes(self, row, real):
        """Whether `row` writes a `real` key: the first of the query rows that share a cache row does."""
        return functools.reduce(tirx.And, self.view.first_of_repeats(0, row), real)


def partial_kernel(batch, seq_kv, dim: int, scale: float, sm_count: int,
                   given: dict[str, Operand] | None = None, dtype: str = "float16",
                   grown: dict[str, int] | None = None, threads: int = THREADS, unroll: int = UNROLL) -> tirx.PrimFunc:
    """(q, k, v, values, max_sum): each (row, chunk) block's softmax state over its keys. `given` places
    q [batch, 1, dim], k and v [batch, seq_kv, dim] in other tensors (the cache, heads shared
    between query heads by a broadcast view). `grown` {"k" or "v": axis}: that operand's view is of
    the concatenation along `axis` of `given`'s "{name}_past" and "{name}_new" tensors, which the
    kernel reads and writes the concatenation itself: (q, k_past, k_new, v..., values, max_sum,
    k_grown, v_grown) for those grown. `threads` a block and `unroll` keys a lane group has in
    flight: the knobs (KNOB_SPACE), which leave the chunks, and so the workspace, as they are."""
    if not fits(batch, seq_kv, dim, given):
        raise ValueError(f"decode attention does not take batch={batch} keys={seq_kv} dim={dim}"
                         + (" and these operand views" if given else ""))
    grown = grown or {}
    views = operands(batch, 1, seq_kv, dim, given)
    (q_shape, q_at), (k_shape, k_at), (v_shape, v_at) = (
        (shape, view.element) for shape, view in (views[name] for name in ("q", "k", "v")))
    kg, vg = (_Grown(views[name][1], given, name, grown[name]) if name in grown else None for name in ("k", "v"))
    grow_k, grow_v = kg is not None, vg is not None
    k_in_shape, v_in_shape = (g.past_shape if g else shape for g, shape in ((kg, k_shape), (vg, v_shape)))
    k_new_shape, v_new_shape = (g.new_shape if g else (1,) for g in (kg, vg))
    lanes = dim // COPY_ELEMS  # lanes per key row, 16 bytes each
    groups = threads // lanes  # keys a block reads at once
    n_splits = splits(batch, seq_kv, sm_count)
    chunk = (seq_kv + n_splits - 1) // n_splits
    steps = (chunk + groups * unroll - 1) // (groups * unroll)
    scale_log2 = float(scale) * LOG2E
    full = tirx.const(0xFFFFFFFF, "uint32")

    @T.macro(hygienic=False)
    def load(regs, tensor, new_rows, at, grows, is_grown, u, key):
        """`unroll`'s `u`th key row of K or V into registers: from the past or the new rows of a grown cache
        (`is_grown`: `grows` is not None, as the Python bool TVMScript's static `if` needs)."""
        if is_grown:
            if key < grows.past_len:
                for e in T.vectorized(COPY_ELEMS):
                    regs[u * COPY_ELEMS + e] = tensor[grows.bases(bx, col)[0] + key * grows.inner + e]
            else:
                for e in T.vectorized(COPY_ELEMS):
                    regs[u * COPY_ELEMS + e] = new_rows[grows.bases(bx, col)[1] + (key - grows.past_len) * grows.inner + e]
        else:
            for e in T.vectorized(COPY_ELEMS):
                regs[u * COPY_ELEMS + e] = tensor[at(bx, key, col + e)]

    @T.macro(hygienic=False)
    def store(regs, grown_out, at, grows, is_grown, u, key):
        """A real key's row of a grown cache from the registers, by the first query row that reads it."""
        if is_grown:
            if grows.writes(bx, key < end):
                for e in T.vectorized(COPY_ELEMS):
                    grown_out[at(bx, key, col + e)] = regs[u * COPY_ELEMS + e]

    @T.prim_func(check_well_formed=False)
    def partial(q_in: T.Buffer(q_shape, dtype), k_in: T.Buffer(k_in_shape, dtype), k_new_in: T.Buffer(k_new_shape, dtype),
                v_in: T.Buffer(v_in_shape, dtype), v_new_in: T.Buffer(v_new_shape, dtype),
                ws: T.Buffer(workspace_shapes(batch, dim)[0], "float32"), ml: T.Buffer(workspace_shapes(batch, dim)[1], "float32"),
                k_out: T.Buffer(k_shape, dtype), v_out: T.Buffer(v_shape, dtype)):
        T.func_attr({"tirx.noalias": True})
        q = T.decl_buffer((math.prod(q_shape),), dtype, data=q_in.data)  # flat: indexed through the views
        k = T.decl_buffer((math.prod(k_in_shape),), dtype, data=k_in.data)
        v = T.decl_buffer((math.prod(v_in_shape),), dtype, data=v_in.data)
        k_new = T.decl_buffer((math.prod(k_new_shape),), dtype, data=k_new_in.data)
        v_new = T.decl_buffer((math.prod(v_new_shape),), dtype, data=v_new_in.data)
        k_grown = T.decl_buffer((math.prod(k_shape),), dtype, data=k_out.data)
        v_grown = T.decl_buffer((math.prod(v_shape),), dtype, data=v_out.data)
        bx = T.launch_thread("blockIdx.x", batch)  # rows fastest: the query heads of one cache head run together
        by = T.launch_thread("blockIdx.y", n_splits)
        tx = T.launch_thread("threadIdx.x", threads)
        q_f = T.alloc_buffer((COPY_ELEMS,), "float32", scope="local")
        k_r = T.alloc_buffer((unroll * COPY_ELEMS,), dtype, scope="local")
        v_r = T.alloc_buffer((unroll * COPY_ELEMS,), dtype, scope="local")
        s = T.alloc_buffer((unroll,), "float32", scope="local")
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
            for u in T.unroll(unroll):  # every load first: unroll rows of K and V in flight
                key = T.meta_var(T.min(start + (i * unroll + u) * groups + g, seq_kv - 1))
                load(k_r, k, k_new, k_at, kg, grow_k, u, key)
                load(v_r, v, v_new, v_at, vg, grow_v, u, key)
            for u in T.unroll(unroll):
                key = T.meta_var(start + (i * unroll + u) * groups + g)
                store(k_r, k_grown, k_at, kg, grow_k, u, key)  # the grown cache, each key once
                store(v_r, v_grown, v_at, vg, grow_v, u, key)
                s[u] = T.float32(0)
                for e in T.unroll(COPY_ELEMS):
                    s[u] = s[u] + q_f[e] * T.Cast("float32", k_r[u * COPY_ELEMS + e])
                for step in T.unroll(int(math.log2(lanes))):  # the row's dot product over its lanes
                    s[u] = s[u] + T.tvm_warp_shuffle_xor(full, s[u], 1 << step, 32, 32)
                s[u] = T.if_then_else(start + (i * unroll + u) * groups + g < end, s[u], T.float32(MASKED))
            state[2] = state[0]
            for u in T.unroll(unroll):
                state[0] = T.max(state[0], s[u])
            state[2] = T.exp2(state[2] - state[0])  # the old state's weight under the new maximum
            state[1] = state[1] * state[2]
            for e in T.unroll(COPY_ELEMS):
                acc[e] = acc[e] * state[2]
            for u in T.unroll(unroll):  # a key past the chunk weighs 0, even while no key of this lane group is real yet
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
        for c in T.serial((dim + threads - 1) // threads):  # the lane groups' states combined, a column a thread
            if c * threads + tx < dim:
                state[0] = T.float32(MASKED)
                for j in T.serial(groups):
                    state[0] = T.max(state[0], ml_sh[j])
                state[1] = T.float32(0)
                state[2] = T.float32(0)
                for j in T.serial(groups):
                    state[1] = state[1] + ml_sh[groups + j] * T.exp2(ml_sh[j] - state[0])
                    state[2] = state[2] + o_sh[j * dim + c * threads + tx] * T.exp2(ml_sh[j] - state[0])
                ws[bx, by, c * threads + tx] = state[2]
                if c * threads + tx == 0:
                    ml[bx, by, 0] = state[0]
                    ml[bx, by, 1] = state[1]

    p = partial.params  # q, k, k_new, v, v_new, values, max_sum, k_grown, v_grown: those of the operands grown
    params = [p[0], p[1], *p[2:3] * grow_k, p[3], *p[4:5] * grow_v, p[5], p[6], *p[7:8] * grow_k, *p[8:9] * grow_v]
    dropped = {*("k_new", "k_grown") * (not grow_k), *("v_new", "v_grown") * (not grow_v)}  # and their flat views
    body = tirx.SeqStmt([x for x in partial.body.seq if not (isinstance(x, tirx.DeclBuffer) and x.buffer.name in dropped)])
    made = {"batch": batch, "seq_kv": seq_kv, "dim": dim, "scale": float(scale), "sm_count": sm_count,
            "given": given, "dtype": dtype, "grown": grown}
    return tirx.PrimFunc(params, body, partial.ret_type, partial.attrs).with_attr(RECIPE, encoded(made))


def combine_kernel(batch, seq_kv, dim: int, sm_count: int, out: Operand | None = None,
                   dtype: str = "float16") -> tirx.PrimFunc:
    """(values, max_sum, out): each row's chunks combined, divided by the sum, written through the `out`
    view (tensor shape, view of [batch, 1, dim]; default contiguous)."""
    out_shape, out_view = out or operands(batch, 1, seq_kv, dim)["out"]
    out_at = out_view.element
    n_splits = splits(batch, seq_kv, sm_count)
    n_splits = n_splits if isinstance(n_splits, int) else tirx.Cast("int32", n_splits)  # <= MAX_SPLITS

    @T.prim_func(check_well_formed=False)
    def combine(ws: T.Buffer(workspace_shapes(batch, dim)[0], "float32"), ml: T.Buffer(workspace_shapes(batch, dim)[1], "float32"),
                out_in: T.Buffer(out_shape, dtype)):
        T.func_attr({"tirx.noalias": True})
        o = T.decl_buffer((math.prod(out_shape),), dtype, data=out_in.data)
        bx = T.launch_thread("blockIdx.x", batch)
        tx = T.launch_thread("threadIdx.x", dim)
        part = T.alloc_buffer((3 * MAX_SPLITS,), "float32", scope="local")  # each chunk's maximum, sum, weighted value
        state = T.alloc_buffer((3,), "float32", scope="local")  # maximum, sum, weighted values
        for j in T.unroll(MAX_SPLITS):  # every chunk's state loaded at once (a chunk past the row's weighs 0)
            part[j] = T.if_then_else(j < n_splits, ml[bx, j, 0], T.float32(MASKED))
            part[MAX_SPLITS + j] = T.if_then_else(j < n_splits, ml[bx, j, 1], T.float32(0))
            part[2 * MAX_SPLITS + j] = T.if_then_else(j < n_splits, ws[bx, j, tx], T.float32(0))
        state[0] = T.float32(MASKED)
        for j in T.unroll(MAX_SPLITS):
            state[0] = T.max(state[0], part[j])
        state[1] = T.float32(0)
        state[2] = T.float32(0)
        for j in T.unroll(MAX_SPLITS):
            state[1] = state[1] + part[MAX_SPLITS + j] * T.exp2(part[j] - state[0])
            state[2] = state[2] + part[2 * MAX_SPLITS + j] * T.exp2(part[j] - state[0])
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


def recipe(func: tirx.PrimFunc) -> dict | None:
    """The keyword arguments of partial_kernel() that made `func` (the knobs aside), or None for any other function."""
    found = (func.attrs or {}).get(RECIPE)
    if found is None:
        return None
    args = decoded(found)
    args["grown"] = {str(name): int(axis) for name, axis in (found["grown"] or {}).items()}
    return args


def _made(func: tirx.PrimFunc, args: dict, knobs: dict) -> tirx.PrimFunc:
    """The partial kernel of `args` at `knobs`, taking its symbolic dims as `func` does, with `func`'s
    other attributes."""
    point = {"threads": int(knobs["threads"]), "unroll": int(knobs["unroll"])}
    made, _ = with_scalar_dims(partial_kernel(**args, **point), outputs=2 + len(args["grown"]))
    return made.with_attrs({k: v for k, v in func.attrs.items() if k not in made.attrs})


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """The points of KNOB_SPACE whose blocks hold a whole key row's lanes (dim / 8)."""
    args = recipe(func)
    if args is None:
        return []
    return [{"strategy": NAME, "threads": t, "unroll": u} for t in KNOB_SPACE["threads"] for u in KNOB_SPACE["unroll"]
            if t >= args["dim"] // COPY_ELEMS]


def heuristic(func: tirx.PrimFunc, sm_count: int = 0, rows=None) -> tuple | None:
    """(DEFAULT_KNOBS, `func` as it is): it was written at them."""
    return None if recipe(func) is None else (dict(DEFAULT_KNOBS), s_tir.Schedule(func))


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    """`func` made again at `knobs`, None where they are no point of its space."""
    if knobs not in knob_space(func):
        return None
    return s_tir.Schedule(_made(func, recipe(func), knobs))


def any_length(args: dict) -> bool:
    """Whether a recipe's batch or cache length is symbolic (built for any)."""
    return not all(isinstance(args[size], int) for size in ("batch", "seq_kv"))


def at_lengths(func: tirx.PrimFunc, dims: dict) -> tirx.PrimFunc:
    """`func` made again with each symbolic size (batch, cache length) set to `dims[its name]`
    (NOMINAL where not given), as a tuning run measures it: a kernel built for any size takes its
    sizes as scalar arguments. As it is where its sizes are static."""
    args = recipe(func)
    if not any_length(args):
        return func
    return _made(func, sized(args, dims), DEFAULT_KNOBS)
