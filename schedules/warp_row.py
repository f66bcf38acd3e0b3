"""GPU strategy for short rows (up to ~2k elements): a warp, or a group of lanes, per row.

`group` lanes (2..32, a power of two) share a row and reduce it with warp shuffles alone;
`rows_per_block` rows fill a block along threadIdx.y, so a 384-wide row does not idle 3/4 of a
block the way one-block-per-row would.
"""

from __future__ import annotations

from .analysis import ROW, ReducePattern, const_int
from .device import Device
from .rows import (REGISTERS, cache_choices, cached_inputs, let_bound, normalises, passes_over, register_vector,
                   row_bytes, rows_dividing, schedule_rows, unaligned_vectors, vector_choices, vector_lanes,
                   worth_caching)

NAME = "warp_row"
MAX_ROW_BYTES = 4096  # longer rows go to block_row
BLOCK_THREADS = 128
# LayerNorm's rows (see default_knobs): four 16-byte vectors a lane or more (at least 8 lanes a row
# whatever the width), rows of 2 KB a block or more
NORMALISING_VECTORS = 4
NORMALISING_MIN_GROUP = 8
NORMALISING_BLOCK_BYTES = 2048
# Rows kept in registers where a lane's share of them is this or less (20 registers: 60 a lane with
# LayerNorm's others, within the 64 that one-warp blocks at 32 a SM leave each); H200, against the
# shared stage at 4 lanes: LayerNorm 65536 x 256 f16 22.9 -> 22.5 us, 32768 x 320 bf16 17.7 -> 16.9,
# 49152 x 1024 f16 54.0 -> 53.5, but 16384 x 384 (96 B a lane) 11.8 -> 12.8 and 32768 x 768 30.5 -> 32.4
# (h200-2026-11-29-sweep-register-rows.log)
REGISTER_SHARE_BYTES = 80


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    if not device.is_gpu or pattern.layout != ROW:
        return None
    n, size = const_int(pattern.reduce_extent), row_bytes(pattern, pattern.input_buffers()[:1])
    if n is None or size > MAX_ROW_BYTES:
        return None
    vec = vector_lanes(pattern)
    fits = [g for g in (32, 16, 8, 4, 2) if g <= device.warp and g * vec <= n]  # every lane gets a vector
    if normalises(pattern):
        # LayerNorm: fewer lanes a row, each with four vectors or more, and blocks of 2 KB of rows,
        # mostly one warp (a device-time sweep of seven LayerNorms over 128-1024 columns on the H200:
        # 384 columns 12.9 -> 11.8 us, 1000 15.8 -> 14.7, the others within 1% of their best:
        # h200-2026-11-28-sweep-short-layernorm.log); the form spelled out follows, so that it keeps
        # the op's schedule
        fits = [g for g in fits if g <= max(NORMALISING_MIN_GROUP, n // (NORMALISING_VECTORS * vec))] or fits
    exact = [g for g in fits if g >= 8 and n % (g * vec) == 0]  # no tail chunk (see rows.py)
    group = (exact or fits or [2])[0]
    threads = BLOCK_THREADS
    if normalises(pattern):
        rows_for_bytes = 1 << max(0, -(-NORMALISING_BLOCK_BYTES // size) - 1).bit_length()
        threads = max(device.warp, group * rows_for_bytes)
    rows = rows_dividing(pattern, max(1, threads // group))
    count = const_int(pattern.row_count)
    few = count is not None and count < rows * device.sm_count
    if few:
        # fewer blocks than SMs: latency-bound, a row a block spreads the rows over more SMs
        # (LayerNorm 64 x 768 f32 6.0 -> 5.0 us, 16 x 1024 f16 5.6 -> 5.0: h200-2026-11-28-sweep-few-short-rows.log)
        rows = 1
    cache = worth_caching(pattern, device, rows)
    if cache and not few and _worth_registers(pattern, group):
        cache, vec = REGISTERS, register_vector(pattern, vec)
    return {"strategy": NAME, "group": group, "rows_per_block": rows, "vec": vec, "cache": cache}


def _worth_registers(pattern: ReducePattern, group: int) -> bool:
    """Whether the heuristic keeps the rows in registers: a lane's share fits REGISTER_SHARE_BYTES
    and the chain reads them three times or more (softmax) or updates a state of several values
    (Welford's). A row read twice (RMSNorm) keeps its shared stage, read in 16-byte vectors
    (RMSNorm 65536 x 512 bf16 37.1 us staged, 37.6 in registers: h200-2026-11-28-beyond.md and
    h200-2026-11-29-beyond-register-rows.md)."""
    inputs = cached_inputs(pattern)
    return ((row_bytes(pattern, inputs) or 0) <= group * REGISTER_SHARE_BYTES
            and (let_bound(pattern) or max(passes_over(pattern, buf) for buf in inputs) >= 3))


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point: lane groups of 2..32 per row, blocks of 32..1024 threads, each vector
    width dividing the row, staged where the block's rows fit shared memory or a lane's share
    fits its registers."""
    n, size = const_int(pattern.reduce_extent), row_bytes(pattern, pattern.input_buffers()[:1])
    if not device.is_gpu or pattern.layout != ROW or n is None or size > MAX_ROW_BYTES:
        return []
    return [{"strategy": NAME, "group": group, "rows_per_block": rows, "vec": vec, "cache": cache}
            for group in (2, 4, 8, 16, 32) if group <= device.warp
            for rows in (1, 2, 4, 8, 16, 32) if device.warp <= group * rows <= device.max_threads
            and rows_dividing(pattern, rows) == rows
            for vec in vector_choices(pattern) if group * vec <= n
            for cache in cache_choices(pattern, group, worth_caching(pattern, device, rows))]


def apply(pattern: ReducePattern, device: Device, knobs: dict):
    group, rows = int(knobs["group"]), int(knobs["rows_per_block"])
    width = const_int(pattern.reduce_extent) or knobs.get("max_extent")
    if not device.is_gpu or pattern.layout != ROW or width is None:
        return None  # the row width must be known, or bounded by the variant's condition
    if unaligned_vectors(pattern, knobs):
        return None  # vectors over a width they may not divide: no tail chunk is tested
    if not 2 <= group <= device.warp or group & (group - 1) or group * rows > device.max_threads:
        return None
    return schedule_rows(pattern, group, rows, int(knobs.get("vec", 1)), knobs.get("cache") or False,
                         knobs.get("reduce_vec"), knobs.get("max_extent"))
