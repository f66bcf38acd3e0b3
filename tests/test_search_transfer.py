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
