"""GPU strategy for reductions across rows (`x.sum(0)`): threads own columns, lanes split rows.

Adjacent `threadIdx.x` own adjacent columns so every load is coalesced; `threadIdx.y` lanes each
reduce a strided share of the rows and are combined by TVM's cross-thread reduction.
"""

from __future__ import annotations

from tvm import s_tir

from .analysis import COLUMN, ReducePattern, const_int
from .device import Device

NAME = "column_reduce"
FEW_ROWS = 16  # rows a thread adds alone (at most the parts of a split K)


def default_knobs(pattern: ReducePattern, device: Device) -> dict | None:
    if not device.is_gpu or pattern.layout != COLUMN:
        return None
    # 16 columns x 64 lanes: 64-byte row segments and enough blocks (faster than 32 x 32; see
    # docs/design.md#row-and-column-templates). A few rows (the 2-16 partial products of a split K)
    # are summed by each thread alone, 256 columns per block: 64 lanes would mostly idle and meet
    # in a shared-memory tree for nothing (docs/design.md#split-k).
    rows = const_int(pattern.reduce_extent)
    if rows is not None and rows <= FEW_ROWS:
        return {"strategy": NAME, "cols": 256, "lanes": 1}
    return {"strategy": NAME, "cols": 16, "lanes": 64}


def knob_space(pattern: ReducePattern, device: Device) -> list[dict]:
    """Every valid point: 4..32 adjacent columns per block, 16..256 lanes over the rows, and the
    heuristic's point where it lies outside that grid (one thread per column for few rows)."""
    if not device.is_gpu or pattern.layout != COLUMN:
        return []
    grid = [{"strategy": NAME, "cols": cols, "lanes": lanes}
            for cols in (4, 8, 16, 32) for lanes in (16, 32, 64, 128, 256) if cols * lanes <= device.max_threads]
    default = default_knobs(pattern, device)
    return grid if default in grid else [default, *grid]


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
        for i, _ in enumerate(sch.get(info.block_rv).writes):  # per thread: a shared buffer's region
            sch.set_scope(info.block_rv, i, "local")  # spans the block's columns, and its lanes summed them too
        sch.compute_at(info.block_rv, col, preserve_unit_loops=True)
        spread_rows(info.block_rv, sch.get_loops(info.block_rv)[2:])
    return sch
