"""The whole loop on the CPU: extract -> search a few trials on llvm -> log -> build from the log -> right answer."""

import json

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from search.strategy import tune_task
from search.tasks import extract_tasks
from tvm_ext.records import Database

TARGET = tvm_ext.parse_target("llvm")


def test_tune_log_build_run(tmp_path, rng):
    mod = relax_module("softmax", [64, 300], "float32")
    (task,) = extract_tasks(mod, TARGET)
    log = tmp_path / "softmax.jsonl"
    result = tune_task(task, TARGET, trials=3, log=str(log), batch=2, progress=False, timeout=120)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == len(result.results) == 3 and all(line["key"] == task.key for line in lines)
    assert result.best is not None and result.best.error is None
    best = min((line for line in lines if line.get("error") is None), key=lambda line: line["us"])
    assert Database.load(log).lookup(task.func, TARGET) == best["knobs"] == result.best.knobs
    x = rng.standard_normal((64, 300)).astype("float32")
    vm = VirtualMachine(tvm_ext.build(mod, TARGET, database=str(log)), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(),
                               np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-5)


def test_failed_measurements_stay_in_the_log_but_are_never_the_best(tmp_path):
    from search.measure import Result  # noqa: PLC0415
    from tvm_ext.records import append_record  # noqa: PLC0415

    (task,) = extract_tasks(relax_module("softmax", [64, 300], "float32"), TARGET)
    log = tmp_path / "log.jsonl"
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 16}, None, "timed out")
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 64}, 12.5, samples=[12.5, 13])
    assert Result({}, [], "x").best_us == float("inf")
    assert Database.load(log).lookup(task.func, TARGET) == {"strategy": "cpu_rows", "lanes": 64}
