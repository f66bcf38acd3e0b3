"""Transfer on the CPU: a log of other shapes picks, with 0 trials, a schedule for a shape it never measured."""

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from tvm_ext.search.measure import Result
from tvm_ext.search.scheduler import each_batch, tune
from tvm_ext.search.strategy import TaskSearch
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.transfer import ModelDatabase
from tvm_ext.records import task_key

TARGET = tvm_ext.parse_target("llvm")
FAST_LANES = 16


def lanes_oracle(func, candidates, dims, on_result=None):
    """On this pretend CPU 16 lanes always win, whatever the shape."""
    return [Result(k, [10.0 * (1 + abs(np.log2(k["lanes"]) - np.log2(FAST_LANES)))]) for k in candidates]


def test_a_never_measured_shape_gets_the_models_pick_and_builds_correctly(tmp_path, rng):
    log = str(tmp_path / "seen.json")
    seen = [t for shape in ([64, 300], [128, 1000], [32, 4096]) for t in extract_tasks(relax_module("softmax", shape, "float32"), TARGET)]
    tune([TaskSearch(t, TARGET, log, budget=3, batch=3) for t in seen], each_batch(lanes_oracle), trials=9, progress=False)
    mod = relax_module("softmax", [96, 2000], "float32")  # a hidden shape
    (hidden,) = extract_tasks(mod, TARGET)
    db = ModelDatabase.load(log)
    assert task_key(hidden.func, TARGET) not in db.best
    assert db.lookup(hidden.func, TARGET) == {"strategy": "cpu_rows", "lanes": FAST_LANES}
    assert db.lookup(seen[0].func, TARGET) == db.best[seen[0].key][1]  # measured tasks: the log's best
    x = rng.standard_normal((96, 2000)).astype("float32")
    vm = VirtualMachine(tvm_ext.build(mod, TARGET, database=db), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(),
                               np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-5)


def test_a_log_too_small_to_train_on_is_refused_by_name(tmp_path):
    log = str(tmp_path / "one.json")
    (t,) = extract_tasks(relax_module("softmax", [64, 300], "float32"), TARGET)
    tune([TaskSearch(t, TARGET, log, budget=1, batch=1)], each_batch(lanes_oracle), trials=1, progress=False)
    with pytest.raises(ValueError, match="one.json' have too few measurements"):
        ModelDatabase.load(log)


def test_the_transfer_bench_counts_what_a_build_gets_with_0_trials():
    """bench.transfer's line: the model's pick where it has one, else the heuristic's point (what
    ModelDatabase leaves to the build); a failed time is no ratio; the bar counts picks within 10%."""
    from bench import transfer  # noqa: PLC0415

    picked = transfer.row("a", {"pick": {"lanes": 1}, "tuned": {"lanes": 16}, "heuristic": {"lanes": 64}},
                          {"pick": 33.0, "tuned": 30.0, "heuristic": 31.0})
    none = transfer.row("b", {"pick": None, "tuned": {"lanes": 16}, "heuristic": {"lanes": 64}},
                        {"tuned": 30.0, "heuristic": 31.5})
    failed = transfer.row("c", {"pick": {"lanes": 1}, "tuned": {"lanes": 16}, "heuristic": None},
                          {"pick": None, "tuned": 30.0})
    assert (picked["zero_trial_us"], picked["ratio"]) == (33.0, pytest.approx(1.1))
    assert (none["zero_trial_us"], none["ratio"]) == (31.5, pytest.approx(1.05))
    assert failed["ratio"] is None
    table = transfer.markdown({"train_logs": ["x.json"], "trials": 64, "rows": [picked, none, failed]})
    assert "| b | 31.5 | 30.0 | 31.5 | 1.050x | `none: the heuristic` |" in table
    assert "| c | error | 30.0 | error | - |" in table
    assert table.endswith("2 of 3 picks within 10% of the tuned time.")


def test_the_offline_transfer_judge_ranks_only_measured_points_of_the_logs_templates():
    """bench.search_quality judges a pick by the table's time: the model ranks the points of today's
    space that the table measured, of the templates its logs have; none left, no pick."""
    from bench.search_quality import _pick  # noqa: PLC0415
    from tvm_ext.search.cost_model import CostModel  # noqa: PLC0415

    (task,) = extract_tasks(relax_module("softmax", [64, 300], "float32"), TARGET)
    rows = [{"knobs": {"strategy": "cpu_rows", "lanes": 3}, "us": [1.0], "error": None},  # no point of the space
            {"knobs": {"strategy": "cpu_rows", "lanes": 16}, "us": [9.0], "error": "wrong result"},
            {"knobs": {"strategy": "cpu_rows", "lanes": 64}, "us": [7.0, 5.0], "error": None}]
    assert _pick(CostModel(), task.func, TARGET, rows) == ({"strategy": "cpu_rows", "lanes": 64}, 5.0)
    pick, us = _pick(CostModel(), task.func, TARGET, rows, strategies={"warp_row"})
    assert pick is None and np.isnan(us)
