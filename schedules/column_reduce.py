"""GPU strategy for reductions across rows (`x.sum(0)`): threads own columns, lanes split rows.

Adjacent `threadIdx.x` own adjacent columns so every load is coalesced; `threadIdx.y` lanes each
reduce a strided share of the rows and are combined by TVM's cross-thread reduction.
"""

from __future__ import annotations

from tvm import s_tir

from .analysis import COLUMN, ReducePattern
from .device import Device

NAME = "column_reduce"


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    if not device.is_gpu or pattern.layout != COLUMN:
        return None
    # 16 columns x 64 lanes: 64-byte row segments and enough blocks (sum over 131072x1024 f32 on
    # the H200: 3404 GB/s, against 2658 at 32 x 32; bench/results sweep log)
    return {"strategy": NAME, "cols": 16, "lanes": 64}


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point: 4..32 adjacent columns per block, 16..256 lanes over the rows."""
    if not device.is_gpu or pattern.layout != COLUMN:
        return []
    return [{"strategy": NAME, "cols": cols, "lanes": lanes}
            for cols in (4, 8, 16, 32) for lanes in (16, 32, 64, 128, 256) if cols * lanes <= device.max_threads]


def apply(pattern: ReducePattern, device: Device, knobs: dict) -> s_tir.Schedule | None:
    if not device.is_gpu or pattern.layout != COLUMN:
        return None
    sch, ns = pattern.sch, pattern.num_spatial
    cols, lanes = int(knobs["cols"]), int(knobs["lanes"])
    if cols * lanes > device.max_threads:
        return None
    last = pattern.blocks[-1]
    loops = sch.get_loops(last.block_rv)
    if (pattern.epilogue is not None and len(loops) > ns) or pattern.row_outputs:
        return None  # element-wise epilogues and several outputs across columns: not served yet
    block_x, col = sch.split(sch.fuse(*loops[:ns]), [None, cols])
    sch.bind(block_x, "blockIdx.x")
    sch.bind(col, "threadIdx.x")

    def spread_rows(block, inner):
        outer, lane = sch.split(sch.fuse(*inner), [None, lanes])
        sch.reorder(lane, outer)
        sch.bind(lane, "threadIdx.y")

    spread_rows(last.block_rv, loops[ns:] if len(loops) > ns else [sch.add_unit_loop(last.block_rv)])
    for info in reversed(pattern.blocks[:-1]):
        for i, _ in enumerate(sch.get(info.block_rv).writes):
            sch.set_scope(info.block_rv, i, "shared")
        sch.compute_at(info.block_rv, col, preserve_unit_loops=True)
        spread_rows(info.block_rv, sch.get_loops(info.block_rv)[2:])
    return sch
