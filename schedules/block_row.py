"""GPU strategy: one thread block per row, the row cached in shared memory when it fits.

Every reduction of the chain is computed under the row's `blockIdx.x`, with its reduce axes
spread over `threadIdx.x` and combined by TVM's cross-thread reduction (warp shuffles plus one
shared-memory round). When the inputs are read by more than one block of the chain (LayerNorm
reads x three times, Softmax twice), the row is first copied into shared memory with 128-bit
loads, so x crosses HBM once.
"""

from __future__ import annotations

from tvm import s_tir

from .analysis import ROW, ReducePattern, const_int
from .device import Device

NAME = "block_row"
UNROLL = 256
# TVM 0.27's CUDA codegen emits a broadcast of 8 float32 lanes as make_ulonglong4(8 floats), which
# nvcc rejects; epilogues compute in float32, so they vectorize by at most 4 lanes (float4).
MAX_EPILOGUE_LANES = 4


def vector_lanes(pattern: ReducePattern, elem_bytes: int) -> int:
    """Widest vector (up to 16 bytes) that divides the row, so vector loads need no tail."""
    n = const_int(pattern.reduce_extent)
    lanes = max(1, 16 // elem_bytes)
    while n is not None and lanes > 1 and n % lanes:
        lanes //= 2
    return lanes if n is not None else 1


def _cached_inputs(pattern: ReducePattern) -> list:
    """Inputs read by two or more blocks of the chain: caching those saves HBM traffic."""
    sch = pattern.sch
    readers = lambda buf: [b for b in pattern.blocks if any(r.source.same_as(buf) for r in sch.get(b.block_rv).reads)]
    return [buf for buf in pattern.input_buffers() if len(readers(buf)) > 1]


def row_cache_bytes(pattern: ReducePattern) -> int | None:
    n = const_int(pattern.reduce_extent)
    if n is None:
        return None
    return sum(n * pattern.dtype_bytes(buf) for buf in _cached_inputs(pattern))


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    if not device.is_gpu or pattern.layout != ROW:
        return None
    n = const_int(pattern.reduce_extent)
    elem = min((pattern.dtype_bytes(b) for b in pattern.input_buffers()), default=4)
    lanes = vector_lanes(pattern, elem)
    threads = 256
    if n is not None:  # about one 16-byte vector per thread per pass, within [warp, max]
        threads = device.warp
        while threads < device.max_threads and threads * lanes * 2 <= n:
            threads *= 2
    cache = row_cache_bytes(pattern)
    return {
        "strategy": NAME,
        "threads": threads,
        "vec": lanes,
        "cache": bool(cache) and cache <= device.smem_bytes,
    }


def _spread(sch: s_tir.Schedule, loops, threads: int, vec: int = 1, vectorize: bool = True):
    """Fuse `loops` and spread them over threadIdx.x in chunks of `vec` adjacent elements.

    Stores and copies vectorize the chunk; a reduction unrolls it, so that its loads from the
    shared-memory cache can still be issued as one wide load.
    """
    outer, tx, lane = sch.split(sch.fuse(*loops), [None, threads, vec])
    sch.reorder(tx, outer, lane)
    sch.bind(tx, "threadIdx.x")
    if vec > 1:
        (sch.vectorize if vectorize else sch.unroll)(lane)
    sch.annotate(outer, "pragma_auto_unroll_max_step", UNROLL)
    sch.annotate(outer, "pragma_unroll_explicit", 1)
    return outer


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    if not device.is_gpu or pattern.layout != ROW:
        return None
    sch, ns = pattern.sch, pattern.num_spatial
    threads, vec = int(knobs["threads"]), int(knobs.get("vec", 1))
    if threads > device.max_threads or threads % device.warp:
        return None
    cached = _cached_inputs(pattern) if knobs.get("cache") else []

    last = pattern.blocks[-1]
    loops = sch.get_loops(last.block_rv)
    row = sch.fuse(*loops[:ns])
    sch.bind(row, "blockIdx.x")
    if len(loops) > ns:  # a reduction, or an epilogue over every element of the row
        _spread(sch, loops[ns:], threads, min(vec, MAX_EPILOGUE_LANES) if pattern.epilogue is not None else 1)
    else:  # one value per row: let thread 0 write it
        _spread(sch, [sch.add_unit_loop(last.block_rv)], threads)

    for info in reversed(pattern.blocks[:-1]):
        for i, _ in enumerate(sch.get(info.block_rv).writes):
            sch.set_scope(info.block_rv, i, "shared")
        sch.compute_at(info.block_rv, row, preserve_unit_loops=True)
        _spread(sch, sch.get_loops(info.block_rv)[1:], threads, vec if cached else 1, vectorize=False)

    for buf in cached:
        consumers = [
            b.block_rv for b in pattern.blocks if any(r.source.same_as(buf) for r in sch.get(b.block_rv).reads)
        ]
        first = sch.get(consumers[0])
        index = [i for i, r in enumerate(first.reads) if r.source.same_as(buf)][0]
        cache = sch.cache_read(consumers[0], index, "shared", consumer_blocks=consumers)
        sch.compute_at(cache, row, preserve_unit_loops=True)
        _spread(sch, sch.get_loops(cache)[1:], threads, vec)
    return sch
