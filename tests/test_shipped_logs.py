"""The tuning logs shipped in tuning_logs/ still describe today's pipeline: every record is a task
the pipeline extracts for the log's model and target (tuning_logs/index.json), with today's feature
schema and knobs its template accepts. A change to fusion, task identity, features or knob spaces
that strands a log fails here; tuning_logs/README.md has the command that regenerates it."""

import json
import os

import pytest

import tvm_ext
from tvm_ext.records import read_records
from tvm_ext.schedules.dispatch import knobs_problem
from tvm_ext.search.cli import load_model
from tvm_ext.search.features import SCHEMA
from tvm_ext.search.tasks import extract_tasks

LOGS = os.path.join(os.path.dirname(__file__), os.pardir, "tuning_logs")
with open(os.path.join(LOGS, "index.json"), encoding="utf-8") as f:
    INDEX = json.load(f)


def test_the_index_lists_every_shipped_log():
    assert sorted(INDEX) == sorted(name for name in os.listdir(LOGS) if name.endswith(".json") and name != "index.json")


@pytest.mark.parametrize("name", sorted(INDEX))
def test_a_shipped_log_matches_the_tasks_its_model_has_today(name):
    entry = INDEX[name]
    target = tvm_ext.parse_target(entry["target"])
    tasks = {task.key: task for task in extract_tasks(load_model(entry["model"]), target)}
    records = list(read_records(os.path.join(LOGS, name)))
    assert records, f"{name} has no usable record"
    stale = sorted({r["task"] for r in records if r["key"] not in tasks})
    assert not stale, f"{name}: tasks {stale} are no longer tasks of {entry['model']}: regenerate the log"
    schemas = {r["features"]["schema"] for r in records if r.get("features")}
    assert schemas == {SCHEMA}, f"{name}: feature schemas {schemas}, today's {SCHEMA}: regenerate the log"
    problems = {r["task"]: knobs_problem(tasks[r["key"]].func, target, r["knobs"]) for r in records}
    assert not any(problems.values()), f"{name}: {problems}"
    assert len({r["key"] for r in records}) >= len(tasks) // 2, f"{name} tunes fewer than half of its tasks"


def test_the_shipped_logs_pick_schedules_for_shapes_none_of_them_measured():
    """Their cost model, trained on every shipped log, answers a LayerNorm, an RMSNorm and a softmax
    of widths no log has with a point of each task's space (0 trials), and a logged task with its best."""
    from bench.suite import relax_module  # noqa: PLC0415
    from tvm_ext.pipeline import fused_reduce_functions  # noqa: PLC0415
    from tvm_ext.search.transfer import ModelDatabase  # noqa: PLC0415

    db = ModelDatabase.load([os.path.join(LOGS, name) for name in sorted(INDEX)])
    target = tvm_ext.parse_target(INDEX["h200-bert-seq512.json"]["target"])
    for op, shape in (("layer_norm", [8192, 2560]), ("rms_norm", [2048, 5120]), ("softmax", [4096, 640])):
        (func,) = fused_reduce_functions(relax_module(op, shape, "float16"), target).values()
        knobs = db.lookup(func, target)
        assert knobs is not None and knobs_problem(func, target, knobs) is None, (op, shape, knobs)
    (logged,) = extract_tasks(load_model("suite:ln-16384x384-f16"), target)
    assert db.lookup(logged.func, target) == db.best[logged.key][1]


def test_the_shipped_model_leaves_templates_it_never_saw_to_their_heuristic():
    """No shipped log measures the fused attention kernel, so their cost model does not pick its point
    (it ranked 2 warpgroups of 128-key tiles first, 7% slower than the default on the H200 for this
    LLaMA shape): the build keeps the kernel as written."""
    from test_attention import SM_90A, spelled  # noqa: PLC0415
    from tvm_ext.search.transfer import ModelDatabase  # noqa: PLC0415

    db = ModelDatabase.load([os.path.join(LOGS, name) for name in sorted(INDEX)])
    assert "attention" not in db.strategies and {"warp_row", "wgmma_matmul"} <= db.strategies
    (task,) = [t for t in extract_tasks(spelled(batch=2, heads=32, seq=512, dim=128), SM_90A) if t.name == "fused_attention"]
    assert db.lookup(task.func, SM_90A) is None
