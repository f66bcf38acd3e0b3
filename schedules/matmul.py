"""Thread-level matmul template: the plain CUDA schedule the auto-tensorization pass recognises.

A block computes a `block_m x block_n` tile of C with a grid of warp tiles; each lane owns
`thread_n` adjacent columns, so a warp covers whole 16x16 tiles, the mapping tir/tensorize.py
needs. A and B go through padded shared memory by `cp.async` with `stages` in flight. fp16/int8."""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .analysis import const_int, multiply_accumulate, size_of
from .contracts import TENSOR_CORE_DTYPES, WARP

NAME = "matmul"
STATIC_SHARED = 48 * 1024  # bytes of static shared memory a block may declare
MAX_SHARED = 227 * 1024  # the most shared memory a block may opt in to (sm_90)


def contraction(func: tirx.PrimFunc, over_c: bool = True):
    """(Schedule, block, epilogue blocks) of a PrimFunc that is one `C[..., i, j] += cast(A[..., i, k])
    * cast(B[..., k, j])` (leading batch axes allowed) with low-precision inputs and a wider
    accumulator, followed by elementwise blocks over C's shape (the cast back to fp16, a bias or a
    residual add: what FuseOps puts after a matmul; with `over_c` False, spatial blocks of any
    shape, which the caller checks); else None."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    if not blocks:
        return None
    block = sch.get(blocks[0])
    kinds = [iv.iter_type for iv in block.iter_vars]
    if len(kinds) < 3 or kinds[-1] != tirx.IterVar.CommReduce or any(k != tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    loads = multiply_accumulate(block.body)
    if not loads or any(len(_axes_used(index, block) - set(_batch_axes(block))) > 1
                        for load in loads for index in load.indices):
        return None  # an index mixing rows, columns or k (a sliding window): not a tile of one matmul
    extents = [iv.dom.extent for iv in block.iter_vars[:-1]]
    for rv in blocks[1:]:
        ivs = sch.get(rv).iter_vars
        if any(iv.iter_type != tirx.IterVar.DataPar for iv in ivs) or over_c and not same_extents(ivs, extents):
            return None
    return sch, blocks[0], blocks[1:]


def static_but_rows(extents) -> bool:
    """Whether a matmul block's extents (batch..., m, n, k) are static, the row count m aside: a
    symbolic m (a sequence length) is served by tiles guarded at C's last row."""
    return all(isinstance(e, tirx.IntImm) for i, e in enumerate(extents) if i != len(extents) - 3)


def same_extents(ivs, extents) -> bool:
    """Whether iterators `ivs` span `extents`, axis by axis."""
    return len(ivs) == len(extents) and all(tvm.sym.Analyzer().can_prove_equal(iv.dom.extent, e)
                                            for iv, e in zip(ivs, extents))


def _batch_axes(block) -> list:
    """The iterators before the block's row, column and k: a batch, or the parts of a split K
    (`a[i, p * K/S + k]`, tvm_ext/relax/split_k.py), which may join k in an operand's index."""
    return [iv.var for iv in block.iter_vars[:-3]]


def _axes_used(index, block) -> set:
    """The block's iterators that `index` reads."""
    axes = {iv.var for iv in block.iter_vars}
    used = []
    tvm_ffi.structural_walk(index, (tirx.Var, lambda v: used.append(v) if v in axes else None), order="pre")
    return set(used)


def part_strides(block) -> list | None:
    """How far each batch axis moves an operand's k index: [] for a plain (batched) matmul, the
    K/S of a split K's parts (`a[i, p * K/S + k]`), None when not a constant."""
    k, batch = block.iter_vars[-1].var, _batch_axes(block)
    strides = []
    for load in multiply_accumulate(block.body):
        for index in load.indices:
            if k in _axes_used(index, block):
                coeffs = tvm.sym.detect_linear_equation(index, batch)
                if len(coeffs) != len(batch) + 1 or any(not isinstance(c, tirx.IntImm) for c in coeffs[:-1]):
                    return None
                strides += [int(c) for c in coeffs[:-1] if int(c)]
    return strides


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
    except Exception:  # a function without the root block is not ours
        return False
    return True


# (block_m, warp_m, thread_n, warp_n, block_k, stages): the tilings the heuristic, the tuner and the
# matmul bench choose from; large output tiles first (each shared-memory tile reused more: 128 x
# 128 tiles leave a large product bound by L2 bandwidth), then the small ones that keep every
# SM busy when M or N is small (at M = 16, one warp per 16 x 64 tile:
# the product streams B, and 8-12 stages keep enough of it in flight; fewer stages starve the
# tensor cores; docs/design.md#auto-tensorization-mmasync).
TILINGS = [
    (128, 64, 2, 4, 32, 4), (128, 64, 2, 4, 64, 3), (256, 64, 2, 2, 32, 4), (128, 64, 2, 2, 64, 3),
    (128, 64, 2, 2, 32, 4), (128, 64, 2, 2, 64, 2), (128, 32, 2, 4, 32, 3), (128, 32, 2, 2, 32, 3),
    (128, 64, 2, 1, 64, 1), (64, 32, 2, 2, 32, 4), (64, 32, 2, 2, 64, 3), (32, 16, 2, 2, 64, 4),
    (16, 16, 2, 2, 64, 4), (16, 16, 2, 4, 64, 4), (16, 16, 2, 1, 64, 12), (16, 16, 2, 1, 64, 8),
    (16, 16, 2, 1, 128, 8),
]


def tiling_knobs(block_m: int, warp_m: int, thread_n: int, warp_n: int, block_k: int, stages: int,
                 itemsize: int = 2) -> dict:
    """A TILINGS entry as knobs; shared rows padded by 16 bytes (8 fp16 or 16 int8 elements: rows
    must stay 16-byte aligned, so the fp16 padding refused every int8 tiling)."""
    return {**default_knobs(), "block_m": block_m, "warp_m": warp_m, "thread_n": thread_n, "warp_n": warp_n,
            "block_n": warp_n * WARP * thread_n, "block_k": block_k, "stages": stages, "pad": 16 // itemsize}


def tensor_core_matmul(func: tirx.PrimFunc):
    """The matmul block of `func` when the template and the tensor cores can take it (static sizes
    but perhaps the row count, fp16/int8 operands, more than one row: a single row is a GEMV,
    memory-bound, which dlight's GEMV rule reads at bandwidth and 16-row tensor-core tiles would
    not), else None."""
    found = contraction(func)
    if found is None:
        return None
    block = found[0].get(found[1])
    if str(multiply_accumulate(block.body)[0].source.dtype) not in TENSOR_CORE_DTYPES:
        return None
    extents = [iv.dom.extent for iv in block.iter_vars]
    return block if static_but_rows(extents) and const_int(extents[-3]) != 1 else None


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """The tilings of TILINGS that fit `func` (the tuner's space for a matmul task)."""
    block = tensor_core_matmul(func)
    if block is None:
        return []
    itemsize = operand_itemsize(block)
    return [knobs for knobs in (tiling_knobs(*t, itemsize) for t in TILINGS) if apply(func, knobs) is not None]


def operand_itemsize(block) -> int:
    """Bytes per element of the matmul block's (low-precision) operands."""
    return tvm.DataType(str(multiply_accumulate(block.body)[0].source.dtype)).bits // 8


def operand_tiles(knobs: dict, k_last: tuple = (True, False)) -> list[tuple[int, int]]:
    """(rows, row length) of A's and B's shared-memory tiles: A is [bm, bk] and B [bk, bn], each
    the other way round when its contiguous index is not the one `k_last` says (a [n, k] weight or
    a transposed key: B's rows are bk long)."""
    bm, bn, bk = (int(knobs[x]) for x in ("block_m", "block_n", "block_k"))
    return [(outer, bk) if last else (bk, outer) for outer, last in zip((bm, bn), k_last)]


def k_is_last(block) -> tuple[bool, bool]:
    """Whether each operand of the matmul block is indexed by k in its last (contiguous) dimension."""
    k, batch = block.iter_vars[-1].var, set(_batch_axes(block))
    return tuple(_axes_used(load.indices[-1], block) - batch == {k} for load in multiply_accumulate(block.body))


def shared_bytes(knobs: dict, itemsize: int, k_last: tuple = (True, False)) -> int:
    """Shared memory of a candidate's operand tiles: `stages` copies of A's and B's padded tiles."""
    pad = int(knobs["pad"])
    return int(knobs["stages"]) * sum(rows * (length + pad) for rows, length in operand_tiles(knobs, k_last)) * itemsize


def heuristic(func: tirx.PrimFunc, sm_count: int, rows: int | None = None) -> tuple[dict, s_tir.Schedule] | None:
    """(knobs, Schedule) of the first tiling in TILINGS order that fits `func` with about one full
    wave of blocks (90% of the SMs or more); failing that, of the fitting tiling with the most
    blocks; tilings whose tiles divide C before those that pad it; None when the template does not
    fit at all (operands the tensor cores cannot take, symbolic sizes, rows that are not a whole
    number of copy vectors). A symbolic row count is planned for as `rows` rows (its tiles always
    guarded)."""
    block = tensor_core_matmul(func)
    if block is None:
        return None
    *batch, m, n = (const_int(iv.dom.extent) for iv in block.iter_vars[:-1])
    if m is None and rows is None:
        return None
    m = m or rows
    candidates = [tiling_knobs(*t, operand_itemsize(block)) for t in TILINGS]

    def ranked(tilings):
        blocks = [math.prod(batch) * -(-m // knobs["block_m"]) * -(-n // knobs["block_n"]) for knobs in tilings]
        filled = [knobs for knobs, count in zip(tilings, blocks) if count >= 0.9 * sm_count]
        return filled + [knobs for count, knobs in sorted(zip(blocks, tilings), key=lambda pair: -pair[0])
                         if count < 0.9 * sm_count]

    whole = [knobs for knobs in candidates if m % knobs["block_m"] == 0 and n % knobs["block_n"] == 0]
    # tiles that divide C first: padding M = 16 up to 128-row tiles does 8x the work
    for knobs in ranked(whole) + ranked([knobs for knobs in candidates if knobs not in whole]):
        sch = apply(func, knobs)
        if sch is not None:
            return knobs, sch
    return None


def default_knobs() -> dict:
    """64 x 64 tiles of 4 warps of 16 rows; 8-element (16-byte) shared-memory copies, rows padded by 8,
    no pipelining."""
    return {"strategy": NAME, "block_m": 64, "block_n": 64, "block_k": 16, "warp_m": 16, "thread_n": 2, "warp_n": 1,
            "vec": 8, "pad": 8, "stages": 1}


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    found = contraction(func)
    if found is None:
        return None
    sch, block, epilogue = found
    bm, bn, bk = int(knobs["block_m"]), int(knobs["block_n"]), int(knobs["block_k"])
    wm, tn, wn = int(knobs["warp_m"]), int(knobs["thread_n"]), int(knobs.get("warp_n", 1))
    vec, pad, stages = int(knobs.get("vec", 1)), int(knobs.get("pad", 0)), int(knobs.get("stages", 1))
    extents = [x.dom.extent for x in sch.get(block).iter_vars]
    if not static_but_rows(extents):
        return None  # symbolic dims but a row count: tiles cannot be checked to divide them
    m, n, k = (size_of(e) for e in extents[-3:])
    itemsize = operand_itemsize(sch.get(block))
    k_last = k_is_last(sch.get(block))
    tiles = operand_tiles(knobs, k_last)
    if any((length + pad) * itemsize % 16 for _, length in tiles):
        return None  # padded shared rows must stay 16-byte aligned (vector copies; WMMA loads need it)
    row_lengths = [load.source.shape[-1] for load in multiply_accumulate(sch.get(block).body)]
    if any(int(length) % vec for length in row_lengths) or int(sch.get(block).writes[0].source.shape[-1]) % tn:
        return None  # each vector copy (of A, of B, of C's columns) must start 16-byte aligned
    strides = part_strides(sch.get(block))
    if strides is None or any(stride % bk for stride in strides):
        return None  # a part of a split K must start at a whole tile of k (aligned copies)
    warps = bm // wm * wn
    threads = warps * WARP
    m, n, k = ((size + tile - 1) // tile * tile for size, tile in ((m, bm), (n, bn), (k, bk)))  # padded up to whole tiles
    if bm % wm or bn != wn * WARP * tn or (bm * bk) % (vec * threads) \
            or (bk * bn) % (vec * threads) or stages < 1 or k // bk < stages:
        return None  # the warps must divide the block's tile, the copies the tiles
    if shared_bytes(knobs, itemsize, k_last) > MAX_SHARED:
        return None  # the launch would fail ("Failed to set the allowed dynamic shared memory size")
    pads, copy_out = [], None
    symbolic = not isinstance(m, int)
    if symbolic or [m, n, k] != [int(e) for e in extents[-3:]]:  # zero-filled operands, the rows and columns past C's edge dropped
        if itemsize == 1 or strides:  # TVM 0.27 prints an int8x8 zero fill as make_int2 of 8 chars (nvcc
            return None  # rejects it); pad_einsum takes no split K's index
        sch.pad_einsum(block, [1] * (len(extents) - 3) + [bm, bn, bk])
        pads = sch.get_producers(block)
        if symbolic or [m, n] != [int(e) for e in extents[-3:-1]]:  # C padded too: pad_einsum copies its rows and columns out
            (copy_out,) = sch.get_consumers(block)  # (a K padded alone leaves C, and its epilogue, as they were)
    staged = None
    if epilogue or copy_out:  # C -> shared staging -> the epilogue, computed as it is written out
        stage = bm * bn * tvm.DataType(str(sch.get(block).writes[0].source.dtype)).bits // 8
        operands = shared_bytes(knobs, itemsize, k_last)
        # Static when the block's shared memory stays under 48 KB: beyond it TVM opts a kernel in to
        # more only for its dynamic part, and the launch fails. Dynamic, it must outsize each operand
        # tile: else TVM's StorageRewrite puts the fp32 stage in a dead fp16 tile, then fails
        # ("tvm_access_ptr element type must match the source buffer").
        if stage + operands > STATIC_SHARED and stage <= stages * max(rows * (length + pad) for rows, length in tiles) * itemsize:
            return None
        scope = "shared" if stage + operands <= STATIC_SHARED else "shared.dyn"
        if copy_out:  # the padded C itself is the stage; its copy to C keeps the bounds check (T.where)
            sch.set_scope(block, 0, scope)  # that reverse_compute_inline would drop, writing past C's rows
            staged = copy_out
        else:
            staged = sch.cache_write(block, 0, scope)
        for consumer in epilogue[:-1]:  # into the blocks reading them: a GELU reads its input twice, a
            sch.compute_inline(consumer)  # DAG reverse_compute_inline cannot fold block by block
        for consumer in epilogue[-1:]:
            sch.reverse_compute_inline(consumer)
    *batch, i, j, kk = sch.get_loops(block)
    bi, wy, ii = sch.split(i, [None, bm // wm, wm])
    bj, wx, tx, jj = sch.split(j, [None, wn, WARP, tn])
    ko, ki = sch.split(kk, [None, bk])
    sch.reorder(bi, bj, wy, wx, tx, ko, ki, ii, jj)
    ty = sch.fuse(wy, wx)
    if batch:
        sch.bind(sch.fuse(*batch), "blockIdx.z")
    sch.bind(bi, "blockIdx.y")
    sch.bind(bj, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.reverse_compute_at(sch.cache_write(block, 0, "local"), tx)
    if staged is not None:  # each warp writes out its own tile, a lane per column group
        sch.reverse_compute_at(staged, ty)
        _, lane, inner = sch.split(sch.fuse(*sch.get_loops(staged)[-2:]), [None, WARP, tn])
        sch.bind(lane, "threadIdx.x")
        sch.vectorize(inner)
    for index in (0, 1):  # A, then B: through shared memory (all threads fetch), then registers
        shared = sch.cache_read(block, index, "shared.dyn")  # dynamic: pipelined tiles outgrow 48 KB
        sch.compute_at(shared, ko)
        fused = sch.fuse(*sch.get_loops(shared)[-2:])
        _, y, x, lanes = sch.split(fused, [None, warps, WARP, vec])
        sch.bind(y, "threadIdx.y")
        sch.bind(x, "threadIdx.x")
        sch.vectorize(lanes)
        if pad:  # rows `pad` elements apart from the next bank pattern: fewer shared-memory bank conflicts
            sch.storage_align(shared, 0, axis=-2, factor=tiles[index][1], offset=pad)
        sch.compute_at(sch.cache_read(block, index, "local"), ki)
    for pad in pads:  # the zero fill computed in the shared-memory copies
        sch.compute_inline(pad)
    if stages > 1:  # ko's body: copy A, copy B, compute; the copies run `stages - 1` steps ahead
        sch.annotate(ko, "software_pipeline_stage", [0, 0, stages - 1])
        sch.annotate(ko, "software_pipeline_order", [0, 1, 2])
        sch.annotate(ko, "software_pipeline_async_stages", [0])
    sch.decompose_reduction(block, ko)
    return sch
