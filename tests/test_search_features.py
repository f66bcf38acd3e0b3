"""Candidate features: one fixed-length, finite vector per point, moving the way the knobs say."""

import numpy as np

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from tvm_ext.search.features import NAMES, candidate_features
from tvm_ext.search.space import knob_space
from tvm_ext.search.tasks import extract_tasks

TARGET = tvm_ext.parse_target(CUDA_TARGET)


def table(op, shape, dtype):
    (task,) = extract_tasks(relax_module(op, shape, dtype), TARGET)
    points = knob_space(task.func, TARGET)
    return points, candidate_features(task.func, points, TARGET)


def test_one_finite_vector_per_point():
    for op, shape, dtype in [("layer_norm", [8192, 4096], "float16"), ("row_sum", [64, 131072], "float32"),
                             ("col_sum", [4096, 1024], "float32"), ("softmax", ["b", 4096], "float16")]:
        points, x = table(op, shape, dtype)
        assert x.shape == (len(points), len(NAMES)) and np.isfinite(x).all()


def test_features_follow_the_knobs():
    points, x = table("layer_norm", [8192, 4096], "float16")
    col = {name: i for i, name in enumerate(NAMES)}
    block = {(p["threads"], p["vec"], p["cache"]): row for p, row in zip(points, x) if p["strategy"] == "block_row"}
    small, large = block[(128, 8, True)], block[(256, 8, True)]
    assert large[col["log2_bytes_per_thread"]] == small[col["log2_bytes_per_thread"]] - 1  # twice the lanes
    assert large[col["threads"]] == 2 * small[col["threads"]] and small[col["staged"]] == 1
    assert block[(128, 1, True)][col["vector_bytes"]] < small[col["vector_bytes"]]
    assert all(row[col["is_block_row"]] == 1 and row[col["is_warp_row"]] == 0 for row in block.values())
    assert 0 < small[col["sm_utilisation"]] <= 1 and 0 < small[col["occupancy"]] <= 1
    # a row kept in registers: staged, but no shared memory; its registers (64 B a lane at 128) cost occupancy
    registers, shared = block[(128, 8, "registers")], block[(128, 8, True)]
    assert registers[col["staged"]] == 1 and registers[col["staged_bytes_per_block"]] == 0 < shared[col["staged_bytes_per_block"]]
    assert registers[col["occupancy"]] != shared[col["occupancy"]]


def test_gemv_candidates_have_features_that_follow_their_knobs():
    """One-row matmuls are tuned too (schedules/gemv.py)."""
    from test_few_row_matmul import matmul_func  # noqa: PLC0415

    func = matmul_func(4096, 4096, rows=1)
    points = knob_space(func, TARGET)
    x = candidate_features(func, points, TARGET)
    assert points and all(p["strategy"] == "gemv" for p in points)
    assert x.shape == (len(points), len(NAMES)) and np.isfinite(x).all() and len({tuple(r) for r in x}) == len(points)
    col = {name: i for i, name in enumerate(NAMES)}
    row = {tuple(p[k] for k in ("rows", "warps", "split", "unroll")): r for p, r in zip(points, x)}
    assert row[(2, 4, 4, 4)][col["log2_lanes_per_row"]] == row[(2, 4, 1, 4)][col["log2_lanes_per_row"]] + 2
    assert row[(2, 4, 4, 8)][col["pipeline_stages"]] == 8 and row[(4, 4, 4, 4)][col["log2_blocks"]] == 10  # 4096 / 4


def test_column_split_candidates_count_their_splits_as_blocks_and_lanes():
    points, x = table("col_sum", [262144, 64], "float32")
    col = {name: i for i, name in enumerate(NAMES)}
    split = {(p["cols"], p["lanes"], p["splits"], p["vec"]): row for p, row in zip(points, x)
             if p["strategy"] == "column_split"}
    assert split and all(row[col["is_column_split"]] == 1 for row in split.values())
    two, eight = split[(32, 16, 2, 1)], split[(32, 16, 8, 1)]
    assert eight[col["log2_blocks"]] == two[col["log2_blocks"]] + 2  # 2 column tiles x splits
    assert eight[col["log2_lanes_per_row"]] == two[col["log2_lanes_per_row"]] + 2  # a column's rows over lanes x splits
    assert split[(16, 16, 8, 4)][col["log2_blocks"]] == two[col["log2_blocks"]] + 1  # one tile of 16 x 4 columns
    assert split[(16, 16, 8, 4)][col["vector_bytes"]] == 16
