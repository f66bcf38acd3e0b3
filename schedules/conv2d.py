"""Direct 2-D convolution on CUDA cores (NCHW input, OIHW weights), with its elementwise epilogue.

TVM's default (dlight's matmul rule over im2col) is slow; this computes the convolution directly,
as TVM's older TOPI schedules did, staging the input window and weights in shared memory. No
tensor cores, static shapes only. See docs/design.md#convolutions."""

from __future__ import annotations

import itertools

import tvm
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad

NAME = "conv2d"
SPATIAL, REDUCE = tirx.IterVar.DataPar, tirx.IterVar.CommReduce
AXES = ("f", "y", "x")  # output channels, rows, columns: each split into (blocks, v, t, i)

# (vf, tf, fi, vy, ty, yi, vx, tx, xi, rc): the heuristic takes the first that fits. The fastest
# tilings of a sweep on a 56-wide ResNet layer (measured: see docs/design.md#convolutions), then
# tiles that divide 28- and 7-wide images.
TILINGS = [
    (1, 8, 4, 1, 2, 4, 1, 4, 2, 4), (1, 16, 4, 2, 2, 2, 1, 4, 2, 4), (1, 16, 4, 1, 1, 4, 1, 7, 4, 4),
    (2, 16, 2, 1, 2, 4, 1, 14, 2, 4), (1, 8, 4, 1, 2, 2, 1, 7, 4, 4), (1, 8, 4, 1, 7, 1, 1, 7, 1, 8),
]


def tiling_knobs(vf, tf, fi, vy, ty, yi, vx, tx, xi, rc) -> dict:
    return {"strategy": NAME, "vf": vf, "tf": tf, "fi": fi, "vy": vy, "ty": ty, "yi": yi,
            "vx": vx, "tx": tx, "xi": xi, "rc": rc, "unroll": 512}


def convolution(func: tirx.PrimFunc):
    """(Schedule, padding blocks, convolution block, epilogue blocks) of a PrimFunc that is an
    optional zero-padding of the input, `out[n, f, y, x] += in[n, c, y*s + r, x*s + q] * w[f, c, r, q]`
    and elementwise blocks over the output's shape; else None."""
    sch = s_tir.Schedule(func)
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # no root block: not a fused TIR function of ours
        return None
    kinds = [[iv.iter_type for iv in sch.get(b).iter_vars] for b in blocks]
    convs = [i for i, k in enumerate(kinds) if k == [SPATIAL] * 4 + [REDUCE] * 3]
    if len(convs) != 1:
        return None
    at = convs[0]
    conv = sch.get(blocks[at])
    if any(k != [SPATIAL] * 4 for k in kinds[:at] + kinds[at + 1:]) or _operands(conv) is None:
        return None
    shape = [iv.dom.extent for iv in conv.iter_vars[:4]]
    for rv in blocks[at + 1:]:
        extents = [iv.dom.extent for iv in sch.get(rv).iter_vars]
        if len(extents) != 4 or any(not tvm.sym.Analyzer().can_prove_equal(a, b) for a, b in zip(extents, shape)):
            return None
    return sch, blocks[:at], blocks[at], blocks[at + 1:]


def _operands(block) -> tuple | None:
    """(input load, weight load) of `c = c + a * w` (casts allowed), the weight indexed [f, c, r, q]
    by the block's own iterators, else None."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, product = store.value.a, store.value.b
    if not isinstance(acc, TensorLoad) or not acc.source.same_as(store.buffer) or not isinstance(product, tirx.Mul):
        return None
    loads = [x.value if isinstance(x, tirx.Cast) else x for x in (product.a, product.b)]
    if not all(isinstance(x, TensorLoad) for x in loads) or len(loads[1].indices) != 4:
        return None
    ivs = [iv.var for iv in block.iter_vars]
    expected = (ivs[1], ivs[4], ivs[5], ivs[6])
    if not all(isinstance(i, tirx.Var) and i.same_as(e) for i, e in zip(loads[1].indices, expected)):
        return None
    return tuple(loads)


def block_tile(knobs: dict) -> list[int]:
    """Output channels, rows and columns one block computes."""
    return [int(knobs["v" + a]) * int(knobs["t" + a]) * int(knobs[a + "i"]) for a in AXES]


def shared_bytes(knobs: dict, r: int, q: int, itemsize: int) -> int:
    """Shared memory of one step: the block's input window (halo included) and its weights."""
    f, y, x = block_tile(knobs)
    rc = int(knobs["rc"])
    return (rc * (y + r - 1) * (x + q - 1) + f * rc * r * q) * itemsize


def knob_space(func: tirx.PrimFunc) -> list[dict]:
    """Tilings that fit `func`: 64-512 threads, 8-64 outputs per thread, shared memory under 48 KB."""
    found = convolution(func)
    extents = None if found is None else _static_extents(found[0].get(found[2]))
    if extents is None:
        return []
    _, f, y, x, c, r, q = extents
    itemsize = tvm.DataType(str(found[0].get(found[2]).writes[0].source.dtype)).bits // 8
    grid = []
    for tiling in itertools.product((1, 2), (4, 8, 16), (1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2, 4),
                                    (1, 2), (2, 4, 7, 8, 14), (1, 2, 4), (4, 8, 16)):
        knobs = tiling_knobs(*tiling)
        vf, tf, fi, vy, ty, yi, vx, tx, xi, rc = tiling
        tiles = block_tile(knobs)
        if f % tiles[0] or y % tiles[1] or x % tiles[2] or c % rc or not 64 <= tf * ty * tx <= 512 \
                or not 8 <= vf * fi * vy * yi * vx * xi <= 64 or shared_bytes(knobs, r, q, itemsize) > 48 * 1024:
            continue
        grid.append(knobs)
    return grid


def _static_extents(block) -> list[int] | None:
    """The convolution block's (n, f, y, x, c, r, q) extents, or None when any is symbolic."""
    extents = [iv.dom.extent for iv in block.iter_vars]
    return [int(e) for e in extents] if all(isinstance(e, tirx.IntImm) for e in extents) else None


def heuristic(func: tirx.PrimFunc) -> tuple[dict, s_tir.Schedule] | None:
    """(knobs, Schedule) of the first tiling in TILINGS that fits `func`, else None."""
    for knobs in (tiling_knobs(*t) for t in TILINGS):
        sch = apply(func, knobs)
        if sch is not None:
            return knobs, sch
    return None


def apply(func: tirx.PrimFunc, knobs: dict) -> s_tir.Schedule | None:
    found = convolution(func)
    if found is None:
        return None
    sch, pads, conv, epilogue = found
    extents = _static_extents(sch.get(conv))
    if extents is None:
        return None
    _, f, y, x, c, _, _ = extents
    parts = {axis: [int(knobs[p + axis]) for p in ("v", "t")] + [int(knobs[axis + "i"])] for axis in AXES}
    rc = int(knobs["rc"])
    if any(size % tile for size, tile in zip((f, y, x), block_tile(knobs))) or c % rc:
        return None
    threads = [parts[a][1] for a in AXES]
    if threads[0] * threads[1] * threads[2] > 1024:
        return None
    data, weight = (_read_index(sch.get(conv), load) for load in _operands(sch.get(conv)))
    writer = sch.cache_write(conv, 0, "local")
    # scale, residual, activation: applied as the registers are written out. The blocks before the
    # last are inlined into what reads them first: x * sigmoid(x) reads its input twice, and a block
    # with two readers cannot be inlined into its producer
    for block in epilogue[:-1]:
        sch.compute_inline(block)
    for block in epilogue[-1:]:
        sch.reverse_compute_inline(block)
    n_loop, f_loop, y_loop, x_loop, rc_loop, r_loop, q_loop = sch.get_loops(conv)
    split = {axis: sch.split(loop, [None, *parts[axis]]) for axis, loop in zip(AXES, (f_loop, y_loop, x_loop))}
    rco, rci = sch.split(rc_loop, [None, rc])
    (bf, vf, tf, fi), (by, vy, ty, yi), (bx, vx, tx, xi) = (split[a] for a in AXES)
    sch.reorder(n_loop, bf, by, bx, vf, vy, vx, tf, ty, tx, rco, rci, r_loop, q_loop, fi, yi, xi)
    sch.bind(sch.fuse(n_loop, bf), "blockIdx.z")
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    for loop, tag in ((vf, "vthread.z"), (vy, "vthread.y"), (vx, "vthread.x"),
                      (tf, "threadIdx.z"), (ty, "threadIdx.y"), (tx, "threadIdx.x")):
        sch.bind(loop, tag)
    sch.reverse_compute_at(writer, tx)
    for index in (data, weight):  # cooperative fetch of the step's window and weights
        shared = sch.cache_read(conv, index, "shared")
        sch.compute_at(shared, rco)
        loops = sch.get_loops(shared)
        fused = sch.fuse(*loops[[sch.get(l).same_as(sch.get(rco)) for l in loops].index(True) + 1:])
        _, z_, y_, x_ = sch.split(fused, [None, *threads])
        for loop, tag in ((z_, "threadIdx.z"), (y_, "threadIdx.y"), (x_, "threadIdx.x")):
            sch.bind(loop, tag)
    for pad in pads:  # the zero padding computed while copying the window
        sch.compute_inline(pad)
    sch.annotate(rco, "pragma_auto_unroll_max_step", int(knobs.get("unroll", 512)))
    sch.annotate(rco, "pragma_unroll_explicit", 1)
    sch.decompose_reduction(conv, rco)
    return sch


def _read_index(block, load) -> int:
    return next(i for i, region in enumerate(block.reads) if region.source.same_as(load.source))
