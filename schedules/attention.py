"""Fused softmax attention on Hopper (`wgmma`): softmax(Q K^T * scale [+ mask]) V in one kernel.

FlashAttention's online softmax: no materialized score matrix. Q, K, V and the output may be
strided views into other tensors. Limits: fp16 or bf16, head dims 64 and 128, finite mask values >= MASK_FLOOR
(no mask with a symbolic length: a scalar parameter of the kernel); sequences that are not whole
tiles run clamped. See
docs/design.md#attention and docs/attention.md."""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T

from .analysis import at_sizes
from .contracts import COPY_ELEMS, MASK_DTYPES, WGMMA_TYPES
from .strided_view import StridedView
from .wgmma_matmul import ATOM_BYTES, ROWS, SWIZZLE_128B, WARPGROUP, accumulator_position, swizzled

ATOM_COLS = 64  # 2-byte columns of one 128-byte swizzled row
HEAD_DIMS = (64, 128)
MASKED = -1.0e30  # finite: a fully masked row of a tile then adds exp2(-1e30 - m) = 0, never NaN
LOG2E = 1.4426950408889634
OPERANDS = ("q", "k", "v", "out")
Operand = tuple[tuple[int, ...], StridedView]  # the tensor passed, and where the logical operand lies in it


def operands(batch: int, seq_q: int, seq_kv: int, dim: int, given: dict[str, Operand] | None = None) -> dict[str, Operand]:
    """Every operand's tensor and view: `given` ones, the rest contiguous [batch, seq, dim]."""
    logical = {"q": (batch, seq_q, dim), "k": (batch, seq_kv, dim), "v": (batch, seq_kv, dim), "out": (batch, seq_q, dim)}
    given = given or {}
    return {name: given.get(name, (shape, StridedView.contiguous(shape))) for name, shape in logical.items()}


def fits(batch: int, seq_q: int, seq_kv: int, dim: int, causal: bool, warpgroups: int = 1, block_n: int = 64,
         given: dict[str, Operand] | None = None, mask: tuple | None = None) -> bool:
    """Whether `kernel` takes these sizes and operand views: Q, K and V rows copied 16 bytes at a
    time need unit-stride head dims on 16-byte boundaries; offsets must fit in int32. `mask`:
    (tensor shape, view of the [batch, seq_q, seq_kv] mask in it, dtype). A symbolic length (a
    tirx expression, no mask) leaves the views to the caller, who checked them at sample lengths."""
    if not isinstance(seq_q, int) or not isinstance(seq_kv, int):  # a symbolic length: the caller checked the views
        return dim in HEAD_DIMS and batch > 0 and mask is None and (not causal or seq_q.same_as(seq_kv))
    if not (dim in HEAD_DIMS and seq_q > 0 and seq_kv > 0 and batch > 0 and (not causal or seq_q == seq_kv)):
        return False
    if mask is not None and (tuple(mask[1].shape) != (batch, seq_q, seq_kv) or mask[2] not in MASK_DTYPES
                             or math.prod(mask[0]) >= 2**31):
        return False
    views = operands(batch, seq_q, seq_kv, dim, given)
    return all(views[name][1].unit_stride_rows(-1, COPY_ELEMS) for name in ("q", "k", "v")) \
        and all(math.prod(shape) < 2**31 for shape, _ in views.values())


def kernel(batch: int, seq_q: int, seq_kv: int, dim: int, scale: float, causal: bool,
           warpgroups: int = 1, block_n: int = 64, given: dict[str, Operand] | None = None,
           mask: tuple | None = None, empty_rows_zero: bool = False, dtype: str = "float16") -> tirx.PrimFunc:
    """The attention PrimFunc (q, k, v, out), or (q, k, v, mask, out) with a `mask` (tensor shape,
    view, dtype: see `fits`), for these sizes; `scale` multiplies the scores; `given` places
    operands in other tensors (default: contiguous [batch, seq, dim] each); `empty_rows_zero`: a
    row whose every key the mask sets to -inf gives 0 (else NaN); `dtype`: of q, k, v and the
    output, fp16 or bf16 (the probabilities are rounded to it for their product with V).
    Defaults: one warpgroup per block, 64-key tiles, the fastest on every BERT and LLaMA shape
    timed (measured: see docs/design.md#attention)."""
    if not fits(batch, seq_q, seq_kv, dim, causal, warpgroups, block_n, given, mask):
        raise ValueError(f"attention kernel does not take batch={batch} seq={seq_q}x{seq_kv} dim={dim} "
                         f"causal={causal} with {warpgroups} warpgroups and {block_n}-key tiles"
                         + (" and these operand views" if given else ""))
    views = operands(batch, seq_q, seq_kv, dim, given)
    (q_shape, q_at), (k_shape, k_at), (v_shape, v_at), (out_shape, out_at) = (
        (shape, view.element) for shape, view in (views[name] for name in OPERANDS))
    bm, threads = warpgroups * ROWS, warpgroups * WARPGROUP
    q_elems, p_elems, kv_elems = bm * dim, bm * block_n, block_n * dim
    p_base = q_elems
    k_base = p_base + p_elems  # then 2 stages of (K tile, V tile)
    stage_elems = 2 * kv_elems
    s_regs, o_regs = block_n // 2, dim // 2
    q_tiles, kv_tiles = -(-seq_q // bm), -(-seq_kv // block_n)
    ragged_q, ragged_kv = (not isinstance(seq, int) or seq % tile != 0 for seq, tile in ((seq_q, bm), (seq_kv, block_n)))
    scale_log2 = float(scale) * LOG2E
    kind = WGMMA_TYPES[dtype]
    s_mma = f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.{kind}.{kind}"
    o_mma = f"wgmma.mma_async.sync.aligned.m64n{dim}k16.f32.{kind}.{kind}"
    full = 0xFFFFFFFF
    masked = mask is not None
    m_shape, m_at, m_dtype = (mask[0], mask[1].element, mask[2]) if masked else ((1,), None, "float16")

    def q_row(qb, row):
        """Row `row` of query tile qb, clamped to the last row where the tile runs past it."""
        return T.min(qb * bm + row, seq_q - 1) if ragged_q else qb * bm + row

    def kv_row(tile, row):
        return T.min(tile * block_n + row, seq_kv - 1) if ragged_kv else tile * block_n + row

    def piece(tx, i):
        """(row, column) of the i-th 16-byte copy of thread tx in a tile `dim` wide."""
        return (tx + i * threads) // (dim // 8), (tx + i * threads) % (dim // 8) * 8

    def kv_copies(k, v, tx, i, tile, bz):
        """Shared offset and global address of thread tx's i-th 16-byte copy of key tile `tile` of
        K, then of V, into the stage tile % 2."""
        row, col = piece(tx, i)
        stage = k_base + tile % 2 * stage_elems
        return (stage + swizzled(row, col, block_n), T.address_of(k[k_at(bz, kv_row(tile, row), col)]),
                stage + kv_elems + swizzled(row, col, block_n), T.address_of(v[v_at(bz, kv_row(tile, row), col)]))

    def k_step(kk, rows):
        """Descriptor offset (16-byte units) of the kk-th 16-wide k step of a k-major tile."""
        return T.uint64((kk // 4 * rows * ATOM_COLS * 2 + kk % 4 * 32) // 16)

    def across_row(x, lane_mask):
        """x of the lane `lane_mask` away: the four lanes tx % 4 hold one row's columns."""
        return T.tvm_warp_shuffle_xor(full, x, lane_mask, 32, 32)

    @T.prim_func(check_well_formed=False)
    def attention(q_in: T.Buffer(q_shape, dtype), k_in: T.Buffer(k_shape, dtype),
                  v_in: T.Buffer(v_shape, dtype), m_in: T.Buffer(m_shape, m_dtype), out_in: T.Buffer(out_shape, dtype)):
        T.func_attr({"tirx.noalias": True})
        q = T.decl_buffer((math.prod(q_shape),), dtype, data=q_in.data)  # flat: indexed through the views
        k = T.decl_buffer((math.prod(k_shape),), dtype, data=k_in.data)
        v = T.decl_buffer((math.prod(v_shape),), dtype, data=v_in.data)
        out = T.decl_buffer((math.prod(out_shape),), dtype, data=out_in.data)
        if masked:
            m = T.decl_buffer((math.prod(m_shape),), m_dtype, data=m_in.data)
        bz = T.launch_thread("blockIdx.y", batch)
        bx = T.launch_thread("blockIdx.x", q_tiles)
        tx = T.launch_thread("threadIdx.x", threads)
        smem = T.alloc_buffer((k_base + 2 * stage_elems,), dtype, scope="shared.dyn")
        s_acc = T.alloc_buffer((s_regs,), "float32", scope="local")
        o_acc = T.alloc_buffer((o_regs,), "float32", scope="local")
        row_m = T.alloc_buffer((2,), "float32", scope="local")  # running maximum (log2 units) of this thread's 2 rows
        row_l = T.alloc_buffer((2,), "float32", scope="local")  # running sum (this thread's columns)
        tile_m = T.alloc_buffer((2,), "float32", scope="local")
        alpha = T.alloc_buffer((2,), "float32", scope="local")
        desc_q = T.alloc_buffer((1,), "uint64", scope="local")
        desc_p = T.alloc_buffer((1,), "uint64", scope="local")
        desc_k = T.alloc_buffer((1,), "uint64", scope="local")
        desc_v = T.alloc_buffer((1,), "uint64", scope="local")
        qb = T.meta_var(q_tiles - 1 - bx if causal else bx)  # causal: the longest rows start first
        n_tiles = T.meta_var(T.min(kv_tiles, ((qb + 1) * bm + block_n - 1) // block_n) if causal else kv_tiles)
        wg_rows = T.meta_var(tx // WARPGROUP * ROWS * ATOM_COLS)
        T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(desc_q[0]), T.address_of(smem[wg_rows]), 1, ATOM_BYTES // 16, SWIZZLE_128B))
        T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(desc_p[0]), T.address_of(smem[p_base + wg_rows]), 1, ATOM_BYTES // 16, SWIZZLE_128B))
        T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(
            T.address_of(desc_k[0]), T.address_of(smem[k_base]), 1, ATOM_BYTES // 16, SWIZZLE_128B))
        T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(  # V: n-major, LBO from one 64-column atom to the next
            T.address_of(desc_v[0]), T.address_of(smem[k_base + kv_elems]), block_n * 128 // 16, ATOM_BYTES // 16, SWIZZLE_128B))
        for h in T.unroll(2):
            row_m[h] = T.float32(MASKED)
            row_l[h] = T.float32(0)
        for r in T.unroll(o_regs):
            o_acc[r] = T.float32(0)
        for i in T.unroll(q_elems // 8 // threads):  # Q, then the first K and V tiles: one group
            row, col = T.meta_var(piece(tx, i))
            T.ptx["cp.async.cg.shared.global"](T.address_of(smem[swizzled(row, col, bm)]),
                                               T.address_of(q[q_at(bz, q_row(qb, row), col)]), 16)
        for i in T.unroll(kv_elems // 8 // threads):
            k_dst, k_src, v_dst, v_src = T.meta_var(kv_copies(k, v, tx, i, 0, bz))
            T.ptx["cp.async.cg.shared.global"](T.address_of(smem[k_dst]), k_src, 16)
            T.ptx["cp.async.cg.shared.global"](T.address_of(smem[v_dst]), v_src, 16)
        T.ptx["cp.async.commit_group"]()
        for j in T.serial(n_tiles):
            T.ptx["cp.async.wait_group"](0)  # tile j (and Q) have landed
            T.ptx["fence.proxy.async.shared::cta"]()
            T.tvm_storage_sync("shared")  # every thread's copies; every warpgroup is done with tile j - 1
            if j + 1 < n_tiles:
                for i in T.unroll(kv_elems // 8 // threads):
                    k_dst, k_src, v_dst, v_src = T.meta_var(kv_copies(k, v, tx, i, j + 1, bz))
                    T.ptx["cp.async.cg.shared.global"](T.address_of(smem[k_dst]), k_src, 16)
                    T.ptx["cp.async.cg.shared.global"](T.address_of(smem[v_dst]), v_src, 16)
            T.ptx["cp.async.commit_group"]()
            for r in T.unroll(s_regs):
                s_acc[r] = T.float32(0)
            T.ptx["wgmma.fence.sync.aligned"]()
            for kk in T.unroll(dim // 16):  # S = Q K^T, 16 of the head dim per step
                T.ptx[s_mma](*[s_acc[r] for r in range(s_regs)],
                             desc_q[0] + k_step(kk, bm), desc_k[0] + T.uint64(j % 2 * stage_elems * 2 // 16) + k_step(kk, block_n),
                             T.bool(True), 1, 1, 0, 0)
            T.ptx["wgmma.commit_group.sync.aligned"]()
            T.ptx["wgmma.wait_group.sync.aligned"](0)
            for h in T.unroll(2):
                tile_m[h] = T.float32(MASKED)
            for r in T.unroll(s_regs):
                row, col = T.meta_var(accumulator_position(tx, r))
                # causal: the keys past a real row include those past the end of the sequence
                if masked:  # the mask's value added (log2 units): -inf stays -inf
                    added = T.meta_var(s_acc[r] * T.float32(scale_log2) + T.Cast("float32", m[m_at(bz, q_row(qb, row), kv_row(j, col))]) * T.float32(LOG2E))
                    if causal:  # -inf, not MASKED: a row that the mask leaves no key must stay all -inf
                        s_acc[r] = T.if_then_else(j * block_n + col > qb * bm + row, T.float32(-math.inf), added)
                    elif ragged_kv:
                        s_acc[r] = T.if_then_else(j * block_n + col >= seq_kv, T.float32(-math.inf), added)
                    else:
                        s_acc[r] = added
                elif causal:
                    s_acc[r] = T.if_then_else(j * block_n + col > qb * bm + row, T.float32(MASKED), s_acc[r] * T.float32(scale_log2))
                elif ragged_kv:
                    s_acc[r] = T.if_then_else(j * block_n + col >= seq_kv, T.float32(MASKED), s_acc[r] * T.float32(scale_log2))
                else:
                    s_acc[r] = s_acc[r] * T.float32(scale_log2)
                tile_m[r // 2 % 2] = T.max(tile_m[r // 2 % 2], s_acc[r])
            for h in T.unroll(2):
                tile_m[h] = T.max(tile_m[h], across_row(tile_m[h], 1))
                tile_m[h] = T.max(tile_m[h], across_row(tile_m[h], 2))
                tile_m[h] = T.max(row_m[h], tile_m[h])
                alpha[h] = T.exp2(row_m[h] - tile_m[h])
                row_m[h] = tile_m[h]
                row_l[h] = row_l[h] * alpha[h]
            for r in T.unroll(s_regs):
                row, col = T.meta_var(accumulator_position(tx, r))
                s_acc[r] = T.exp2(s_acc[r] - row_m[r // 2 % 2])
                row_l[r // 2 % 2] = row_l[r // 2 % 2] + s_acc[r]
                smem[p_base + swizzled(row, col, bm)] = T.Cast(dtype, s_acc[r])
            for r in T.unroll(o_regs):
                o_acc[r] = o_acc[r] * alpha[r // 2 % 2]
            T.ptx["fence.proxy.async.shared::cta"]()  # P written by every thread, then read by wgmma
            T.tvm_storage_sync("shared")
            T.ptx["wgmma.fence.sync.aligned"]()
            for kk in T.unroll(block_n // 16):  # O += P V, 16 keys per step
                T.ptx[o_mma](*[o_acc[r] for r in range(o_regs)],
                             desc_p[0] + k_step(kk, bm),
                             desc_v[0] + T.uint64((j % 2 * stage_elems * 2 + kk * 16 * 128) // 16),
                             T.bool(True), 1, 1, 0, 1)
            T.ptx["wgmma.commit_group.sync.aligned"]()
            T.ptx["wgmma.wait_group.sync.aligned"](0)
        for h in T.unroll(2):
            row_l[h] = row_l[h] + across_row(row_l[h], 1)
            row_l[h] = row_l[h] + across_row(row_l[h], 2)
        for r in T.unroll(o_regs):
            row, col = T.meta_var(accumulator_position(tx, r))
            result = T.meta_var(T.Cast(dtype, T.if_then_else(
                row_l[r // 2 % 2] > T.float32(0), o_acc[r] / row_l[r // 2 % 2], T.float32(0)))
                if empty_rows_zero else T.Cast(dtype, o_acc[r] / row_l[r // 2 % 2]))  # empty: o and l are 0
            if ragged_q:
                if qb * bm + row < seq_q:  # rows past the sequence's end are not stored
                    out[out_at(bz, qb * bm + row, col)] = result
            else:
                out[out_at(bz, qb * bm + row, col)] = result

    q_buf, k_buf, v_buf, m_buf, out_buf = attention.params  # no mask: the parameter goes
    lengths = [seq_q] if isinstance(seq_q, tirx.Var) else []  # a symbolic length: passed, as FuseTIR passes dims
    made = {"batch": batch, "seq_q": seq_q, "seq_kv": seq_kv, "dim": dim, "scale": float(scale), "causal": causal,
            "given": given, "mask": mask, "empty_rows_zero": empty_rows_zero, "dtype": dtype}
    return tirx.PrimFunc([q_buf, k_buf, v_buf, *([m_buf] if masked else []), *lengths, out_buf], attention.body,
                         attention.ret_type, attention.attrs).with_attr(RECIPE, encoded(made))


# A tuning task: the kernel is written at DEFAULT_KNOBS before dispatch, carrying the arguments it was
# made from (RECIPE), so that the dispatcher can make it again at another point of KNOB_SPACE.
NAME = "attention"
RECIPE = "tvm_ext.attention_recipe"
KNOB_SPACE = {"warpgroups": (1, 2), "block_n": (64, 128)}
DEFAULT_KNOBS = {"strategy": NAME, "warpgroups": 1, "block_n": 64}


def _view(v: StridedView) -> dict:
    return {"axes": v.axes, "offset": v.offset}


def _plain(x):
    """An attribute's ints and expressions as they were, its containers as tuples."""
    return tuple(_plain(y) for y in x) if isinstance(x, (list, tuple, tvm_ffi.Array)) else x


def _unview(v) -> StridedView:
    return StridedView(_plain(v["axes"]), _plain(v["offset"]))


def encoded(made: dict) -> dict:
    """A kernel's arguments as a function attribute (RECIPE, decode_attention.RECIPE): the operand
    views of `given` (and of `mask`, where there is one) as their pieces and offset."""
    given = {name: [shape, _view(v)] for name, (shape, v) in (made["given"] or {}).items()}
    mask = made.get("mask") and [made["mask"][0], _view(made["mask"][1]), made["mask"][2]]
    return {**made, "given": given, **({"mask": mask} if "mask" in made else {})}


def decoded(found) -> dict:
    """The keyword arguments an attribute `encoded` holds."""
    args = {str(key): _plain(value) for key, value in found.items() if key not in ("given", "mask")}
    args["given"] = {str(name): (_plain(shape), _unview(v)) for name, (shape, v) in found["given"].items()}
    if "mask" in found:
        mask = found["mask"]
        args["mask"] = None if mask is None else (_plain(mask[0]), _unview(mask[1]), str(mask[2]))
    return args


def recipe(func: tirx.PrimFunc) -> dict | None:
    """The keyword arguments of kernel() that made `func` (the knobs aside), or None for any other function."""
    found = (func.attrs or {}).get(RECIPE)
    return None if found is None else decoded(found)


def sizes(args: dict) -> tuple:
    """(batch, seq_q, seq_kv, dim) of a recipe."""
    return args["batch"], args["seq_q"], args["seq_kv"], args["dim"]


def any_length(args: dict) -> bool:
    """Whether a recipe's kernel was built for any length (a symbolic size)."""
    return not all(isinstance(x, int) for x in sizes(args))


def at_lengths(func: tirx.PrimFunc, dims: dict) -> tirx.PrimFunc:
    """`func` made again with each symbolic length set to `dims[its name]` (NOMINAL where not given),
    its other attributes kept: a kernel built for any length takes the length as a scalar argument,
    so a tuning run measures it as the kernel of one length (its knobs are the same)."""
    args = recipe(func)
    if not any_length(args):
        return func
    made = kernel(**sized(args, dims), **{k: v for k, v in DEFAULT_KNOBS.items() if k != "strategy"})
    made = made.without_attr("global_symbol")
    return made.with_attrs({k: v for k, v in func.attrs.items() if k not in made.attrs})


def sized(args: dict, dims: dict) -> dict:
    """A recipe's arguments (sizes, operand views) with each symbolic size set to `dims[its name]`
    (NOMINAL where not given, analysis.at_sizes); a mask's as they are."""
    def fixed(x):
        if isinstance(x, tuple):
            return tuple(fixed(y) for y in x)
        if isinstance(x, StridedView):
            return StridedView(fixed(x.axes), fixed(x.offset))
        return at_sizes(x, dims) if tvm.ir.is_prim_expr(x) else x
    return {key: fixed(value) for key, value in args.items() if key not in ("given", "mask")} | {
        "given": {name: fixed(operand) for name, operand in args["given"].items()}} | (
        {"mask": args["mask"]} if "mask" in args else {})


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """The points of KNOB_SPACE the kernel takes for `func`'s sizes and views (over a symbolic
    length, the points the kernel takes at any length: `fits`)."""
    args = recipe(func)
    if args is None:
        return []
    return [{"strategy": NAME, "warpgroups": w, "block_n": n}
            for w in KNOB_SPACE["warpgroups"] for n in KNOB_SPACE["block_n"]
            if fits(*sizes(args), args["causal"], w, n, args["given"], args["mask"])]


def launch(args: dict, knobs: dict) -> tuple[int, int, int]:
    """(threads a block, blocks, shared-memory bytes a block) of a recipe at `knobs`: a warpgroup
    per 64 query rows, Q's tile, P's and two stages of K's and V's tiles of `block_n` keys."""
    batch, seq_q, _, dim = sizes(args)
    warpgroups, block_n = int(knobs["warpgroups"]), int(knobs["block_n"])
    rows = warpgroups * ROWS
    return warpgroups * WARPGROUP, batch * -(-seq_q // rows), (rows * dim + rows * block_n + 4 * block_n * dim) * 2


def flops(args: dict) -> int:
    """Multiply-adds of QK^T and PV, twice (half the scores are computed for a causal mask)."""
    batch, seq_q, seq_kv, dim = sizes(args)
    return 4 * batch * seq_q * seq_kv * dim // (2 if args["causal"] else 1)


def heuristic(func: tirx.PrimFunc, sm_count: int = 0, rows=None) -> tuple | None:
    """(DEFAULT_KNOBS, `func` as it is): it was written at them."""
    return None if recipe(func) is None else (dict(DEFAULT_KNOBS), s_tir.Schedule(func))


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    """`func` made again at `knobs` (its other attributes kept), None where the kernel does not take them."""
    args = recipe(func)
    point = {"warpgroups": int(knobs["warpgroups"]), "block_n": int(knobs["block_n"])}
    if args is None or not fits(*sizes(args), args["causal"], **point, given=args["given"], mask=args["mask"]):
        return None
    made = kernel(**args, **point).without_attr("global_symbol")
    return s_tir.Schedule(made.with_attrs({k: v for k, v in func.attrs.items() if k not in made.attrs}))
