"""The log under faults: concurrent appenders, a torn line, Ctrl-C mid-run then --resume, bad CLI input."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

import tvm_ext
from bench.suite import relax_module
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.records import append_record, read_records

TARGET = tvm_ext.parse_target("llvm")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNE = [sys.executable, os.path.join(ROOT, "scripts", "tune.py")]


def softmax_task():
    (task,) = extract_tasks(relax_module("softmax", [64, 300], "float32"), TARGET)
    return task


def append_many(log, writer, count):
    task = softmax_task()
    for i in range(count):
        append_record(log, task.func, TARGET, task.name, {"writer": writer, "i": i, "pad": "x" * 2000}, float(i + 1))


def test_two_concurrent_appenders_leave_whole_lines(tmp_path):
    log, count = str(tmp_path / "shared.json"), 150
    context = mp.get_context("spawn")
    writers = [context.Process(target=append_many, args=(log, w, count)) for w in range(2)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    lines = open(log, encoding="utf-8").read().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert len(records) == 2 * count
    assert sorted((r["knobs"]["writer"], r["knobs"]["i"]) for r in records) == [(w, i) for w in range(2) for i in range(count)]


def test_a_torn_last_line_is_skipped_and_never_swallows_the_next_record(tmp_path):
    task = softmax_task()
    log = tmp_path / "torn.json"
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 1}, 30.0)
    with open(log, "a", encoding="utf-8") as f:
        f.write('{"version": 1, "key": "half a reco')  # a writer killed mid-line
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 16}, 20.0)
    with pytest.warns(UserWarning, match="skipped 1 unusable line"):
        records = list(read_records(log))
    assert [r["knobs"]["lanes"] for r in records] == [1, 16]


def test_ctrl_c_mid_run_then_resume_reaches_the_budget_without_repeats(tmp_path):
    model = tmp_path / "two_norms.py"
    model.write_text("from examples.transformer_norms import build_module  # noqa: F401\n")
    log = tmp_path / "run.json"
    args = TUNE + ["--model", str(model), "--target", "llvm", "--trials", "8", "--batch", "2", "--log", str(log)]
    run = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT),  # started with SIGINT ignored, as a script's
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # background job is
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130 and "add --resume to continue" in err, err
    before = [json.loads(line) for line in log.read_text().splitlines()]  # whole lines only
    assert 2 <= len(before) < 8
    resumed = subprocess.run(args + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=ROOT))
    assert resumed.returncode == 0, resumed.stderr
    after = [json.loads(line) for line in log.read_text().splitlines()]
    assert after[:len(before)] == before and len(after) == 8
    measured = [(r["key"], json.dumps(r["knobs"], sort_keys=True)) for r in after]
    assert len(set(measured)) == 8  # the resumed run never re-measured a point
    assert "| rms_norm |" in resumed.stdout and "speed-up" in resumed.stdout


@pytest.mark.parametrize("argv, message", [
    (["--model", "no_such_model", "--target", "llvm"], "no model 'no_such_model'"),
    (["--model", "suite:nope", "--target", "llvm"], "no suite case 'nope'"),
    (["--model", "transformer_norms", "--target", "llvm", "--dims", "n=big"], "--dims expects NAME=INT"),
    (["--model", "transformer_norms", "--target", "tpu"], "unsupported target string 'tpu'"),
])
def test_bad_cli_input_is_named(tmp_path, argv, message):
    out = subprocess.run(TUNE + argv + ["--trials", "1", "--log", str(tmp_path / "x.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "x.json").exists()


def _children(pid: int) -> set:
    """Pids whose parent is `pid` (the tuner's spawned workers and resource tracker)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _alive(pids: set) -> set:
    return {p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]}


def _tune_until_measuring(tmp_path):
    """A tuner on llvm, its scratch folder under tmp_path/tmp, once it has logged a measurement."""
    log, scratch = tmp_path / "run.json", tmp_path / "tmp"
    scratch.mkdir()
    args = TUNE + ["--model", "transformer_norms", "--target", "llvm", "--trials", "40", "--batch", "8", "--log", str(log)]
    run = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(scratch)))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not log.exists() or not log.read_text().strip()):
        time.sleep(0.2)
    return run, log, scratch, _children(run.pid)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the tuner's workers")
def test_sigterm_ends_the_workers_keeps_the_log_and_removes_the_scratch_files(tmp_path):
    run, log, scratch, workers = _tune_until_measuring(tmp_path)
    assert workers, "the tuner started no workers"
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143 and "terminated" in err and "add --resume to continue" in err, err[-500:]
    assert all(json.loads(line) for line in log.read_text().splitlines())  # whole records only
    deadline = time.monotonic() + 10
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers)
    assert not any(p.name.startswith("tvm_ext_measure_") for p in scratch.iterdir())


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the tuner's workers")
def test_workers_of_a_killed_tuner_exit_within_seconds_and_free_its_pipes(tmp_path):
    run, _, _, workers = _tune_until_measuring(tmp_path)
    assert workers
    run.kill()
    run.communicate(timeout=30)  # hangs while an orphaned worker holds the pipes
    deadline = time.monotonic() + 10
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers)


def test_each_measurement_is_logged_as_it_finishes(tmp_path):
    from tvm_ext.search.measure import Result  # noqa: PLC0415
    from tvm_ext.search.strategy import TaskSearch  # noqa: PLC0415

    log = tmp_path / "batch.json"
    search = TaskSearch(softmax_task(), TARGET, str(log), budget=8, batch=4)

    def interrupted(func, candidates, dims, on_result=None):
        on_result(1, Result(candidates[1], [5.0]))  # the second candidate finished first
        raise KeyboardInterrupt  # Ctrl-C while the others run

    batch = search.propose(4)
    with pytest.raises(KeyboardInterrupt):
        batch.close(interrupted(search.task.func, batch.candidates, {}, on_result=batch.on_result))
    (record,) = read_records(str(log))
    assert record["us"] == 5.0 and record["knobs"] == search.points[search.measured[0]]


def test_a_point_whose_worker_never_started_is_measured_again_on_resume(tmp_path):
    from tvm_ext.search.worker_pool import WORKER_DID_NOT_START  # noqa: PLC0415
    from tvm_ext.search.strategy import TaskSearch  # noqa: PLC0415

    task, log = softmax_task(), str(tmp_path / "resumed.json")
    fresh = TaskSearch(task, TARGET, log, budget=8)
    machinery, candidate = fresh.points[:2]
    append_record(log, task.func, TARGET, task.name, machinery, None, f"{WORKER_DID_NOT_START} within 300 s")
    append_record(log, task.func, TARGET, task.name, candidate, None, "timed out after 60 s")  # the candidate's own
    resumed = TaskSearch(task, TARGET, log, budget=8, past=list(read_records(log)))
    assert [resumed.points[i] for i in resumed.measured] == [candidate]
