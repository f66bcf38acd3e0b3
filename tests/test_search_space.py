"""The search space: the heuristic's choice is in it, and every point of it schedules."""

import random

import pytest

from tvm_ext import schedules
import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from tvm_ext.search.space import knob_space
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.tir import check_builds

CASES = [("layer_norm", [8192, 4096], "float16"), ("softmax", [4096, 1000], "float16"),
         ("row_sum", [64, 131072], "float32"), ("col_sum", [4096, 1024], "float32"),
         ("col_sum", [262144, 64], "float32"), ("col_sum", [512, 4096], "float32"), ("col_sum", [1048576, 4], "float32"),
         ("rms_norm", [16, 262144], "bfloat16"), ("rms_norm", [37, 32768], "bfloat16"),
         ("full_sum", [268435456], "float32"), ("bn_stats", [32, 64, 28, 28], "float32")]


@pytest.mark.parametrize("op, shape, dtype", CASES)
@pytest.mark.parametrize("target", [CUDA_TARGET, "llvm"])
def test_heuristic_choice_is_a_point_and_sampled_points_schedule_and_lower(op, shape, dtype, target):
    target = tvm_ext.parse_target(target)
    for task in extract_tasks(relax_module(op, shape, dtype), target):
        points = knob_space(task.func, target)
        chosen = schedules.heuristic_knobs(task.func, target)
        assert any(all(p.get(k) == v for k, v in chosen.items()) for p in points), (chosen, points[:3])
        for knobs in random.Random(0).sample(points, min(6, len(points))):
            sch = schedules.schedule(task.func, target, knobs)
            assert sch is not None, knobs
            if target.kind.name == "cuda":
                check_builds(sch.mod["main"], task.name, target)


def test_space_is_large_enough_to_search_and_has_no_duplicates():
    target = tvm_ext.parse_target(CUDA_TARGET)
    (task,) = extract_tasks(relax_module("softmax", [4096, 1000], "float16"), target)
    points = knob_space(task.func, target)
    assert len(points) >= 50 and len({tuple(sorted(p.items())) for p in points}) == len(points)
    assert {p["strategy"] for p in points} == {"warp_row", "block_row"}
