"""Tuning logs are validated when read: bad latencies, undecodable bytes and knobs that are no point of
their strategy's space are skipped with a warning naming the log and line; a log that cannot take
records is refused before any work; a build says how many tasks took a record."""

import json
import logging
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

from tvm_ext.search import tuner as search_tuner
import tvm_ext
from bench.suite import reference, relax_module
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.tuner import tune_model
from tvm_ext.records import Database, append_record, read_records

TARGET = tvm_ext.parse_target("llvm")
GOOD = {"strategy": "cpu_rows", "lanes": 16}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def softmax():
    mod = relax_module("softmax", [64, 300], "float32")
    (task,) = extract_tasks(mod, TARGET)
    return mod, task


def _line(log, **changes) -> str:
    """A record line like append_record's, with `changes` to its fields."""
    rec = json.loads(log.read_text().splitlines()[0])
    rec.update(changes)
    return json.dumps(rec)


@pytest.mark.parametrize("raw, problem", [
    ("NaN", "latency nan is not a finite positive number"),
    ("Infinity", "latency inf is not a finite positive number"),
    ("-3.0", "latency -3.0 is not a finite positive number"),
    ("0", "latency 0 is not a finite positive number"),
    ("true", "latency True is not a finite positive number"),
    ('"12.5"', "latency '12.5' is not a finite positive number"),
])
def test_a_latency_that_is_not_a_finite_positive_number_is_skipped_and_named(tmp_path, raw, problem):
    _, task = softmax()
    log = tmp_path / "log.json"
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 64}, 20.0)
    bad = _line(log, knobs=GOOD, us=0).replace('"us": 0', f'"us": {raw}')
    log.write_text(log.read_text() + bad + "\n")
    with pytest.warns(UserWarning) as caught:
        records = list(read_records(log))
    assert [r["us"] for r in records] == [20.0]
    assert str(caught[0].message) == f"tvm_ext: skipped 1 unusable line(s) of tuning log {log}: line 2: {problem}"


def test_a_failed_measurement_needs_an_error_text_and_is_never_the_best(tmp_path):
    _, task = softmax()
    log = tmp_path / "log.json"
    append_record(log, task.func, TARGET, task.name, GOOD, 30.0)
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 64}, 5.0, "wrong result")
    log.write_text(log.read_text() + _line(log, us=1.0, error=True) + "\n")
    with pytest.warns(UserWarning, match=r"skipped 1 unusable line\(s\) of tuning log .*log.json: "
                                         r"line 3: error True is not a text$"):
        db = Database.load(log)
    assert db.best == {task.key: (30.0, GOOD, 1)}


def test_undecodable_bytes_are_skipped_with_the_log_and_line_named(tmp_path):
    """A non-UTF-8 byte raised UnicodeDecodeError out of the build, naming neither log nor line."""
    mod, task = softmax()
    log = tmp_path / "log.json"
    append_record(log, task.func, TARGET, task.name, GOOD, 10.0)
    log.write_bytes(log.read_bytes() + b'{"key": "\xff\xfe"}\n')
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 64}, 20.0)
    message = rf"skipped 1 unusable line\(s\) of tuning log {log}: line 2: not UTF-8 \(byte 0xff at column 10\)"
    with pytest.warns(UserWarning, match=message):
        assert [r["us"] for r in read_records(log)] == [10.0, 20.0]
    with pytest.warns(UserWarning, match=message):
        db = Database.load(log)
    assert db.lookup(task.func, TARGET) == GOOD and db.best[task.key][2] == 1


def test_many_bad_lines_are_counted_and_the_first_five_named(tmp_path):
    log = tmp_path / "log.json"
    log.write_text("".join(f"junk {i}\n" for i in range(8)))
    with pytest.warns(UserWarning, match=r"skipped 8 unusable line\(s\) of tuning log .*: line 1: not JSON; line 2: "
                                         r"not JSON; line 3: not JSON; line 4: not JSON; line 5: not JSON; 3 more$"):
        assert list(read_records(log)) == []


def _run(executable, rng):
    x = rng.standard_normal((64, 300)).astype("float32")
    got = VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, reference("softmax", [x])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("knobs, problem", [
    ({"strategy": "cpu_rows", "lanes": 3}, "are not a point of the cpu_rows strategy's space for this function"),
    ({"strategy": "block_row", "threads": 64, "vec": 4, "cache": False},
     "are not a point of the block_row strategy's space for this function"),
    ({"strategy": "matmul", "tile": 64}, "are for the matmul template, which this target does not use"),
    ({"strategy": "no_such", "lanes": 16}, "name no strategy of tvm_ext \\(known: warp_row, "),
])
def test_knobs_that_do_not_fit_the_function_and_target_give_the_heuristic_with_a_warning(tmp_path, rng, knobs,
                                                                                         problem):
    mod, task = softmax()
    log = tmp_path / "log.json"
    append_record(log, task.func, TARGET, task.name, knobs, 5.0)
    with pytest.warns(UserWarning) as caught:
        executable = tvm_ext.build(mod, "llvm", database=log)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"tvm_ext: tuning log {log} line 1: knobs {json.dumps(knobs, sort_keys=True)} ")
    assert messages[0].endswith("; using the heuristic schedule") and re.search(problem, messages[0])
    assert messages[1] == (f"tvm_ext: tuning log {log} has a usable record for none of the 1 task(s) of this build "
                           "(it holds 1); using heuristic schedules")
    _run(executable, rng)


def test_a_build_logs_how_many_tasks_took_a_record_and_warns_once_when_none_did(tmp_path, rng, caplog):
    mod, task = softmax()
    log = tmp_path / "log.json"
    append_record(log, task.func, TARGET, task.name, GOOD, 5.0)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="tvm_ext.api"):
        warnings.simplefilter("error")  # a log that matches says so quietly
        _run(tvm_ext.build(mod, "llvm", database=log), rng)
    assert f"tvm_ext: 1 of 1 task(s) took a record of tuning log {log}" in caplog.messages
    other = tmp_path / "other.json"
    (norm,) = extract_tasks(relax_module("layer_norm", [64, 300], "float32"), TARGET)
    append_record(other, norm.func, TARGET, norm.name, GOOD, 5.0)
    with pytest.warns(UserWarning) as caught:
        _run(tvm_ext.build(mod, "llvm", database=other), rng)
    assert [str(w.message) for w in caught] == [
        f"tvm_ext: tuning log {other} has a usable record for none of the 1 task(s) of this build (it holds 1); "
        "using heuristic schedules"]


def _no_work(*args, **kwargs):
    raise AssertionError("the tuner started work on a log it cannot write")


def test_a_directory_or_an_unwritable_log_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(search_tuner, "parse_target", _no_work)
    mod = relax_module("softmax", [64, 300], "float32")
    with pytest.raises(IsADirectoryError, match=rf"^tuning log '{tmp_path}' is a directory: name a log file$"):
        tune_model(mod, TARGET, trials=2, log=str(tmp_path), progress=False)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        tune_model(mod, TARGET, trials=2, log=str(tmp_path), resume=True, progress=False)
    with pytest.raises(PermissionError, match=r"^tuning log '/proc/version' is not writable \(.+\)$"):
        tune_model(mod, TARGET, trials=2, log="/proc/version", resume=True, progress=False)
    (tmp_path / "file").write_text("")
    inside_a_file = str(tmp_path / "file" / "sub" / "log.json")
    with pytest.raises(PermissionError, match=rf"^tuning log '{inside_a_file}' cannot be created: "
                                              rf"'{tmp_path / 'file'}' is not a writable folder$"):
        tune_model(mod, TARGET, trials=2, log=inside_a_file, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_tune_py_refuses_a_directory_as_its_log_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tune.py"), "--model", "transformer_norms",
                          "--target", "llvm", "--trials", "1", "--log", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == f"tune.py: tuning log '{tmp_path}' is a directory: name a log file\n"
    assert os.listdir(tmp_path) == []
