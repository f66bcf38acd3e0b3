"""GPU strategy: one thread block per row, staged in shared memory or registers when the row fits.

For rows from about 2k elements up: the block's lanes split the row, the block all-reduce is warp
shuffles plus one shared-memory round. Rows that do not fit shared memory are read again from
global memory by each pass of the chain (from L2 only while the rows in flight fit in it).
"""

from __future__ import annotations

from .analysis import ROW, ReducePattern, const_int
from .device import Device
from .rows import (REGISTERS, cache_choices, cached_inputs, estimated_registers, fits_registers, let_bound, register_vector, row_bytes,
                   schedule_rows, unaligned_vectors, vector_choices, vector_lanes, worth_caching)

NAME = "block_row"
BYTES_PER_THREAD = 64  # four 16-byte loads in flight per thread: best or near it in bench.sweep
VECTOR_BYTES = 16  # one load a thread for a few rows of Welford: LayerNorm [1, 4096] 6.0 us against 6.9 (H100)
# Rows re-read from memory with an element-wise epilogue run much faster at 512 threads than at
# 1024: the smaller block leaves room for more blocks per SM (docs/design.md#row-and-column-templates).
MAX_THREADS_UNCACHED_EPILOGUE = 512
# Rows of this many staged bytes or more are kept in registers at REGISTER_THREADS lanes (8-32 of
# a lane's elements), not staged in shared memory, where a lane's vector stays as wide (16 bytes of
# float32); H200, staged (heuristic) against registers at 512: LayerNorm 8192 x 4096 f32 70.6 -> 68.9
# us, 1024 x 16384 f32 43.3 -> 40.0 (h200-2026-11-29-sweep-register-rows.log). Halves would take
# 8-byte vectors (rows.register_vector) and lose: LayerNorm 4096 x 8192 f16 40.0 -> 42.3 us, softmax
# 2048 x 32768 f16 71.9 -> 77.7, RMSNorm 2048 x 32768 bf16 70.9 -> 72.8 (h200-2026-11-29-suite-register-rows.md
# against h200-2026-11-28-suite.md); LayerNorm 2048 x 32768 f16 gained (83.2 -> 75.3).
REGISTER_ROW_BYTES = 16 * 1024
REGISTER_THREADS = 512


def default_knobs(pattern: ReducePattern, device: Device, few_rows: bool | None = None) -> dict | None:
    """The heuristic's knobs; `few_rows`: for fewer rows than SMs (None: as the row count says, many
    where it is symbolic)."""
    if not device.is_gpu or pattern.layout != ROW:
        return None
    size = row_bytes(pattern, pattern.input_buffers()[:1])
    rows = const_int(pattern.row_count)
    # fewer rows than SMs (a decoding step's LayerNorm): the time is the latency of each thread's
    # serial chain of updates, long for a state of several values (Welford's), not the bandwidth
    if few_rows is None:
        few_rows = rows is not None and rows < device.sm_count
    per_thread = VECTOR_BYTES if few_rows and let_bound(pattern) else BYTES_PER_THREAD
    threads = 256
    if size is not None:
        threads = device.warp
        while threads < device.max_threads and threads * 2 * per_thread <= size:
            threads *= 2
    cache = worth_caching(pattern, device)
    if not cache and pattern.epilogue is not None and pattern.epilogue.dom_kind() != "S" * pattern.num_spatial:
        threads = min(threads, MAX_THREADS_UNCACHED_EPILOGUE)
    staged = (row_bytes(pattern, cached_inputs(pattern)) or 0) if cache else 0
    vec = vector_lanes(pattern)
    if (not few_rows and staged >= REGISTER_ROW_BYTES and fits_registers(pattern, REGISTER_THREADS)
            and register_vector(pattern, vec) == vec):
        return {"strategy": NAME, "threads": REGISTER_THREADS, "vec": vec, "cache": REGISTERS}
    return {"strategy": NAME, "threads": _by_occupancy(threads, pattern, device, staged), "vec": vec,
            "cache": cache}


def _by_occupancy(threads: int, pattern: ReducePattern, device: Device, smem: int) -> int:
    """Halve the block while that keeps a quarter more threads resident per SM (registers and the
    staged row permitting); on smaller gains the larger block stays. E.g. LayerNorm over 32k f16
    rows at 1024 threads and 40 registers a thread leaves room for one block per SM (measured: see
    docs/design.md#row-and-column-templates)."""
    registers = estimated_registers(pattern)

    def resident(t):
        return t * device.resident_blocks(t, registers, smem)

    while threads > 2 * device.warp and resident(threads // 2) >= 1.25 * resident(threads):
        threads //= 2
    return threads


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point: blocks of 64..1024 threads, each vector width dividing the row, staged
    where the row fits shared memory (and its width is static) or a lane's share fits its registers."""
    if not device.is_gpu or pattern.layout != ROW:
        return []
    staged = const_int(pattern.reduce_extent) is not None and worth_caching(pattern, device)
    return [{"strategy": NAME, "threads": threads, "vec": vec, "cache": cache}
            for threads in (64, 128, 256, 512, 1024) if threads <= device.max_threads
            for vec in vector_choices(pattern)
            for cache in cache_choices(pattern, threads, staged)]


def apply(pattern: ReducePattern, device: Device, knobs: dict):
    threads = int(knobs["threads"])
    if not device.is_gpu or pattern.layout != ROW or threads > device.max_threads or threads % device.warp:
        return None
    if unaligned_vectors(pattern, knobs):
        return None  # vectors over a width they may not divide: no tail chunk is tested
    if knobs.get("cache") is True and const_int(pattern.reduce_extent) is None:
        return None  # TVM sizes a symbolic stage by the whole tensor (see dispatch.DYNAMIC_ROW_VARIANTS)
    return schedule_rows(pattern, threads, 1, int(knobs.get("vec", 1)), knobs.get("cache") or False,
                         knobs.get("reduce_vec"), knobs.get("max_extent"))
