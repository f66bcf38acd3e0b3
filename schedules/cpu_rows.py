"""CPU strategy: rows in parallel across cores, each row's whole chain computed while it is in cache.

A long row's reduction keeps `lanes` partials (rfactor) combined at the end, so a float32 sum or
Welford state carries the rounding of n/lanes serial steps, not of n."""

from __future__ import annotations

from tvm import s_tir

from .analysis import ReducePattern, const_int
from .device import Device

NAME = "cpu_rows"
LANES = 64


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    return None if device.is_gpu else {"strategy": NAME, "lanes": LANES}


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Partial results per reduction: none (1), 16 or 64."""
    return [] if device.is_gpu else [{"strategy": NAME, "lanes": lanes} for lanes in (1, 16, 64)]


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    if device.is_gpu:
        return None
    sch = pattern.sch
    if not pattern.blocks[-1].iters:
        return None  # a whole tensor reduced to one value: no rows to run in parallel
    if not pattern.merge_outputs():
        return None
    partials = [_split_lanes(sch, info.block_rv, int(knobs.get("lanes", 1))) for info in pattern.row_reductions]
    loops = sch.get_loops(pattern.blocks[-1].block_rv)
    row = sch.fuse(*loops[: pattern.num_spatial])
    sch.parallel(row)
    for info, partial in reversed(list(zip(pattern.row_reductions, partials))):
        sch.compute_at(info.block_rv, row, preserve_unit_loops=True)
        if partial is not None:
            sch.compute_at(partial, row, preserve_unit_loops=True)
    return sch


def _split_lanes(sch: s_tir.Schedule, block, lanes: int):
    """rfactor `block` into `lanes` partial reductions over its innermost axis; the partial block,
    or None where the axis is too short or does not divide."""
    innermost = sch.get_loops(block)[-1]
    extent = const_int(sch.get(innermost).extent)
    if lanes <= 1 or extent is None or extent % lanes or extent < 4 * lanes:
        return None
    return sch.rfactor(sch.split(innermost, [None, lanes])[1], factor_axis=0)
