"""Measurement in worker processes: good candidates are timed; crashing, hanging and wrong ones cost one trial."""

import functools
import math
import os
import time

import numpy as np
import pytest
import tvm

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from tvm_ext.search.builder import build_candidate
from tvm_ext.search.check import references
from tvm_ext.search.measure import Measurer, measure
from tvm_ext.search.runner import run_candidate
from tvm_ext.search.space import knob_space
from tvm_ext.search.tasks import extract_tasks
from test_search_loop import _linear_bias

TARGET = tvm_ext.parse_target("llvm")
CPU_ROWS = {"strategy": "cpu_rows", "lanes": 16}


def task():
    (t,) = extract_tasks(relax_module("softmax", [64, 300], "float32"), TARGET)
    return t


def crashing_runner(*args):
    os._exit(3)


def hanging_runner(*args):
    time.sleep(60)


def output_zeroing_builder(output: int, *args):
    """The real builder, with a template that writes zeros to parameter `output` (-1: the last
    output, the softmax; -2: the first of two, add + RMSNorm's residual sum)."""
    import tvm_ffi  # noqa: PLC0415
    from tvm import tirx  # noqa: PLC0415

    from tvm_ext import schedules  # noqa: PLC0415

    real = schedules.schedule

    def zeroing(func, target, knobs):
        out = func.params[output]
        zero = lambda st: tirx.BufferStore(st.buffer, tirx.const(0, st.value.ty.dtype), st.indices) \
            if st.buffer.same_as(out) else st  # noqa: E731
        return real(func.with_body(tvm_ffi.structural_map(func.body, (tirx.BufferStore, zero))), target, knobs)

    schedules.schedule = zeroing
    try:
        return build_candidate(*args)
    finally:
        schedules.schedule = real


zeroing_builder = functools.partial(output_zeroing_builder, -1)  # a partial of a module function: it pickles


def test_good_candidates_are_timed_and_checked():
    t = task()
    results = measure(t.func, TARGET, knob_space(t.func, TARGET)[:3], timeout=120, builders=2)
    assert [r.error for r in results] == [None, None, None]
    assert all(len(r.us) >= 3 and 0 < r.best_us < 1e5 for r in results)


def runner_finding_the_reference_ready(func_json, target_json, dims, scratch, *args):
    """The real runner, after checking that a builder computed the task's reference before it."""
    from tvm_ext.search.runner import reference_path  # noqa: PLC0415

    if not os.path.exists(reference_path(func_json, dims, scratch)):
        raise AssertionError("the runner had to compute the reference itself")
    return run_candidate(func_json, target_json, dims, scratch, *args)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_builder_computes_the_reference_before_the_runner_needs_it(overlap):
    """Also where candidates run while others build (a GPU's runner): not before the reference is there."""
    t = task()
    with Measurer(TARGET, builders=2, timeout=120, runner=runner_finding_the_reference_ready) as measurer:
        measurer.overlap = overlap
        results = measurer.measure(t.func, knob_space(t.func, TARGET)[:2])
    assert [r.error for r in results] == [None, None]


def test_a_crash_or_a_hang_costs_one_trial_and_the_next_candidate_still_runs():
    t = task()
    with Measurer(TARGET, builders=1, timeout=120) as measurer:
        started = time.monotonic()
        measurer.runner = crashing_runner
        (crashed,) = measurer.measure(t.func, [CPU_ROWS])
        assert crashed.us == [] and "exit code 3" in crashed.error and time.monotonic() - started < 30
        measurer.runner, measurer.timeout = hanging_runner, 3
        (hung,) = measurer.measure(t.func, [CPU_ROWS])
        assert hung.us == [] and "timed out after 3 s" in hung.error
        measurer.runner, measurer.timeout = run_candidate, 120
        (good,) = measurer.measure(t.func, [CPU_ROWS])
        assert good.error is None and good.best_us > 0


def test_refused_knobs_are_an_error_not_a_latency():
    t = task()
    (result,) = measure(t.func, TARGET, [{"strategy": "warp_row", "group": 32, "rows_per_block": 4}], timeout=120)
    assert result.us == [] and "refuses" in result.error


def test_wrong_result_is_an_error_never_a_latency():
    t = task()
    (result,) = measure(t.func, TARGET, [CPU_ROWS], builder=zeroing_builder, timeout=120)
    assert result.us == [] and result.error.startswith("ValueError: wrong result"), result.error


def test_a_library_built_elsewhere_is_checked_and_timed_like_a_candidate(tmp_path):
    import tvm  # noqa: PLC0415

    t = task()
    lib = tvm.compile(tvm.IRModule({"main": t.func.with_attr("global_symbol", "main")}), target=TARGET)
    lib.export_library(str(tmp_path / "plain.so"))
    with Measurer(TARGET, builders=1, timeout=120) as measurer:
        good = measurer.time_library(t.func, str(tmp_path / "plain.so"))
        missing = measurer.time_library(t.func, str(tmp_path / "missing.so"))
    assert good.error is None and good.best_us > 0
    assert missing.us == [] and missing.error


def test_bf16_layer_norm_reference_is_right(tmp_path):
    """The reference of a bf16 Welford LayerNorm built for the GPU: TVM's CPU bf16 lowering gets such
    reductions wrong (max error 17.7), so every GPU candidate failed its check before the fix."""
    import numpy as np  # noqa: PLC0415
    import tvm  # noqa: PLC0415

    from conftest import CUDA_TARGET  # noqa: PLC0415
    from tvm_ext.search.runner import expected  # noqa: PLC0415

    (t,) = extract_tasks(relax_module("layer_norm", [256, 512], "bfloat16"), tvm_ext.parse_target(CUDA_TARGET))
    got = expected(tvm.ir.save_json(t.func), {}, tvm.cpu(), str(tmp_path))
    x, g, b = (a.numpy().astype("float64") for a in got.inputs)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    assert np.abs(got.outputs[0].want.reshape(want.shape) - want).max() < 0.1


def test_a_runner_keeps_the_last_tasks_it_measured_within_its_budget(tmp_path, monkeypatch):
    """The scheduler returns to a task batch after batch: its Expected is kept (the same object,
    not loaded and sent again) while the last tasks fit the budget, the oldest let go first."""
    from tvm_ext.search import runner  # noqa: PLC0415

    funcs = [tvm.ir.save_json(extract_tasks(relax_module("softmax", [64, n], "float32"), TARGET)[0].func)
             for n in (256, 512, 1024)]
    sizes = [64 * n * 4 * 2 for n in (256, 512, 1024)]  # float32 input and output
    monkeypatch.setattr(runner, "_EXPECTED", runner.Kept(budget=sizes[0] + sizes[1]))
    first = runner.expected(funcs[0], {}, tvm.cpu(), str(tmp_path))
    second = runner.expected(funcs[1], {}, tvm.cpu(), str(tmp_path))
    assert runner.expected(funcs[0], {}, tvm.cpu(), str(tmp_path)) is first
    assert [size for _, size in runner._EXPECTED.items.values()] == [sizes[1], sizes[0]]
    runner.expected(funcs[2], {}, tvm.cpu(), str(tmp_path))  # over the budget: both older ones go
    assert len(runner._EXPECTED.items) == 1
    assert runner.expected(funcs[1], {}, tvm.cpu(), str(tmp_path)) is not second


def test_a_matmul_reference_reads_float32_operands_on_parallel_rows(rng):
    """The unscheduled fp16 reference of a 512 x 4096 x 4096 Linear took 92 s on the CPU; this one
    converts the operands once (exactly) and spreads rows over cores, and must still be right."""
    (task,) = extract_tasks(_linear_bias(64, 128, 256), tvm_ext.parse_target(CUDA_TARGET))
    (ref,) = references(task.func)
    assert [str(p.ty.dtype) for p in ref.params] == ["float32", "float32", "float16", "float16"]
    assert "T.parallel" in ref.script() and "T.vectorized" in ref.script()
    a, w, b = (rng.standard_normal(s).astype("float16") for s in ([64, 256], [256, 128], [128]))
    lib = tvm.compile(tvm.IRModule({"main": ref.with_attr("global_symbol", "main")}), target="llvm")
    args = [tvm.runtime.tensor(x) for x in (a.astype("float32"), w.astype("float32"), b)] + \
        [tvm.runtime.empty([64, 128], "float16")]
    lib["main"](*args)
    want = (a.astype("float32") @ w.astype("float32")).astype("float16").astype("float32") + b.astype("float32")
    np.testing.assert_allclose(args[-1].numpy().astype("float32"), want.astype("float16").astype("float32"),
                               rtol=2e-3, atol=2e-3)


def test_a_job_is_not_timed_out_for_its_workers_start_up():
    from tvm_ext.search.worker_pool import Pool  # noqa: PLC0415

    pool = Pool(1)  # a fresh spawned worker spends seconds importing TVM before it takes the job
    try:
        ((status, value),) = pool.map(math.factorial, [(5,)], timeout=0.05)
    finally:
        pool.close()
    assert (status, value) == ("ok", 120)


def test_a_round_measures_several_tasks_batches_at_once():
    """Two tasks' batches in one round: each candidate built and checked against its own task's
    reference, the results back per batch in order, each reported to its batch as it finishes."""
    tasks = [task(), extract_tasks(relax_module("rms_norm", [128, 512], "float32"), TARGET)[0]]
    batches = [(t.func, knob_space(t.func, TARGET)[:2], {}, None) for t in tasks]
    seen = [[], []]
    batches = [(func, cands, dims, functools.partial(lambda b, i, r: seen[b].append((i, r.knobs)), b))
               for b, (func, cands, dims, _) in enumerate(batches)]
    with Measurer(TARGET, builders=2, timeout=120) as measurer:
        results = measurer.measure_round(batches)
    assert [[r.knobs for r in rs] for rs in results] == [b[1] for b in batches]
    assert all(r.error is None and r.best_us > 0 for rs in results for r in rs)
    assert [sorted(i for i, _ in reported) for reported in seen] == [[0, 1], [0, 1]]
    assert all(knobs == batches[b][1][i] for b in (0, 1) for i, knobs in seen[b])


def test_a_free_runner_takes_a_task_it_ran_before_then_a_new_task_then_any():
    """An RPC runner keeps a task's tensors on its server: its task's next candidates go to it, a
    task no runner has run goes to a free runner, and a runner with nothing of its own takes any
    job rather than idle (one task's batch still spreads over every server)."""
    from tvm_ext.search.worker_pool import Pool  # noqa: PLC0415

    pool, first, second = Pool(2), object(), object()  # the order of jobs only: no process started
    for job, task in [("a1", "A"), ("a2", "A"), ("b1", "B"), ("a3", "A"), ("b2", "B"), ("c1", "C")]:
        pool.submit(job, None, (), 1.0, affinity=task)
    taken = lambda worker: pool._take(worker)[0]  # noqa: E731
    assert [taken(first), taken(second)] == ["a1", "b1"]  # each a task of its own
    assert [taken(second), taken(first), taken(first)] == ["b2", "a2", "a3"]  # back to its own task
    assert taken(second) == "c1"  # nothing of its own left: a task no runner ran
    pool.submit("a4", None, (), 1.0, affinity="A")
    assert taken(second) == "a4"  # only another runner's task is left: taken rather than idle
    pool._forget(first)
    pool.submit("a5", None, (), 1.0, affinity="A")
    assert taken(second) == "a5" and pool.homes["A"] is second  # its runner gone: the task finds a new one


def test_a_worker_that_finishes_takes_the_next_job_in_the_same_look():
    """Pool.poll collects the ended jobs before it hands out pending ones: a runner that finishes a
    candidate starts the next in the same call, not one poll interval later."""
    from tvm_ext.search.worker_pool import Pool  # noqa: PLC0415

    pool = Pool(1)
    try:
        for job in ("first", "second"):
            pool.submit(job, math.factorial, (5,), 60.0)
        ended, deadline = [], time.monotonic() + 60
        while not ended and time.monotonic() < deadline:
            ended = pool.poll()
            time.sleep(0.001)
        assert [job for job, _ in ended] == ["first"]
        assert not pool.pending and [w.job for w in pool.busy] == ["second"]  # started in that same poll
        while not pool.idle and time.monotonic() < deadline:
            ended += pool.poll()
    finally:
        pool.close()
    assert [(job, answer) for job, answer in ended] == [("first", ("ok", 120)), ("second", ("ok", 120))]
