"""CPU strategy: rows in parallel across cores, each row's whole chain computed while it is in cache."""

from __future__ import annotations

from tvm import s_tir

from .analysis import ReducePattern
from .device import Device

NAME = "cpu_rows"


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    return None if device.is_gpu else {"strategy": NAME}


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    if device.is_gpu:
        return None
    sch = pattern.sch
    if not pattern.merge_outputs():
        return None
    loops = sch.get_loops(pattern.blocks[-1].block_rv)
    row = sch.fuse(*loops[: pattern.num_spatial])
    sch.parallel(row)
    for info in reversed(pattern.row_reductions):
        sch.compute_at(info.block_rv, row, preserve_unit_loops=True)
    return sch
