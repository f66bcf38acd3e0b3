"""Our tuning log exported as a MetaSchedule database, read back with stock TVM only (no GPU needed)."""

import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir.meta_schedule.database import JSONDatabase

from tvm_ext import schedules
import tvm_ext
from bench.suite import relax_module
from tvm_ext.search.metaschedule import export_metaschedule, normalize_mod, workload_of
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.pipeline import fused_module
from tvm_ext.records import append_record

LLVM = tvm_ext.parse_target("llvm")
CUDA = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_90"})
RMS = ("rms_norm", [64, 4096], "float32")  # 4096 splits into 16 or 64 lanes: three distinct cpu_rows kernels


def task_of(case, target, **options):
    (task,) = extract_tasks(relax_module(*case), target, **options)
    return task


def ours(task, target, knobs) -> tvm.IRModule:
    """Our scheduled module, as MetaSchedule normalises a function (the database's form)."""
    return normalize_mod(schedules.schedule(task.func, target, knobs).mod["main"])


def stock_db(result) -> JSONDatabase:
    return JSONDatabase(path_workload=result["workload"], path_tuning_record=result["tuning_record"])


def test_stock_jsondatabase_gives_back_our_schedule(tmp_path):
    task, knobs = task_of(RMS, LLVM), {"strategy": "cpu_rows", "lanes": 16}
    log = tmp_path / "log.jsonl"
    append_record(log, task.func, LLVM, task.name, knobs, 12.5)
    result = export_metaschedule(log, [task], LLVM, tmp_path / "ms")
    assert result["exported"] == {task.key: {"task": task.name, "us": 12.5}} and result["skipped"] == {}

    db = stock_db(result)
    (record,) = db.get_all_tuning_records()
    assert [float(s) for s in record.run_secs] == pytest.approx([12.5e-6])
    workload = workload_of(task.func)
    got = db.query_ir_module(workload, LLVM, "main")
    assert tvm_ffi.structural_equal(got, ours(task, LLVM, knobs))
    assert tvm_ffi.structural_equal(db.query_schedule(workload, LLVM, "main").mod, got)
    assert not tvm_ffi.structural_equal(got, workload), "the record must schedule the function"
    script = got.script()  # rows over cores, 16 partial sums per row (rfactor)
    assert "T.parallel(T.int64(64))" in script and "T.sblock_alloc_buffer((T.int64(16), T.int64(64)))" in script


def test_best_record_is_exported_and_failures_never(tmp_path):
    task = task_of(RMS, LLVM)
    other = task_of(("softmax", [64, 300], "float32"), LLVM)
    log = tmp_path / "log.jsonl"
    append_record(log, task.func, LLVM, task.name, {"strategy": "cpu_rows", "lanes": 1}, 40.0)
    append_record(log, task.func, LLVM, task.name, {"strategy": "cpu_rows", "lanes": 64}, 25.0)
    append_record(log, task.func, LLVM, task.name, {"strategy": "cpu_rows", "lanes": 16}, None, error="timed out")
    # timed, but the check against the reference failed: a latency with an error is still a failure
    append_record(log, task.func, LLVM, task.name, {"strategy": "cpu_rows", "lanes": 16}, 1.0, error="wrong result")
    append_record(log, other.func, LLVM, other.name, {"strategy": "cpu_rows", "lanes": 1}, None, error="wrong result")
    result = export_metaschedule(log, [task, other], LLVM, tmp_path / "ms")
    assert result["exported"] == {task.key: {"task": task.name, "us": 25.0}}
    assert result["skipped"] == {other.key: {"task": other.name, "reason": "no successful record in the log"}}

    db = stock_db(result)
    (record,) = db.get_all_tuning_records()  # one task, one record: neither failure got in
    assert [float(s) for s in record.run_secs] == pytest.approx([25e-6])
    assert db.query_ir_module(workload_of(other.func), LLVM, "main") is None
    got = db.query_ir_module(workload_of(task.func), LLVM, "main")
    assert tvm_ffi.structural_equal(got, ours(task, LLVM, {"strategy": "cpu_rows", "lanes": 64}))
    assert not tvm_ffi.structural_equal(got, ours(task, LLVM, {"strategy": "cpu_rows", "lanes": 1}))


@pytest.mark.parametrize("case, target, knobs, options, exported", [
    (("softmax", [64, 1024], "float16"), CUDA,
     {"strategy": "warp_row", "group": 32, "rows_per_block": 4, "vec": 8, "cache": True}, {}, True),
    (("rms_norm", [256, 4096], "float32"), CUDA, {"strategy": "block_row", "threads": 256, "vec": 4, "cache": True},
     {}, True),
    (("col_sum", [4096, 1024], "float32"), CUDA, {"strategy": "column_reduce", "cols": 16, "lanes": 64}, {}, True),
    # written as TVMScript around the fused function: no trace reproduces it
    (("row_sum", [64, 131072], "float32"), CUDA, {"strategy": "grid_reduce", "blocks_per_row": 32, "threads": 512,
                                                  "vec": 4}, {}, False),
    (("softmax", [32, 65536], "float32"), CUDA, {"strategy": "grid_sync", "blocks_per_row": 8, "threads": 512,
                                                 "vec": 4, "cache": True}, {}, False),
    # Welford's pivot read makes match() rewrite the read regions: the trace starts from that rewrite
    (("layer_norm", [256, 1024], "float16"), LLVM, {"strategy": "cpu_rows", "lanes": 16}, {}, False),
    (("layer_norm", [256, 1024], "float16"), LLVM, {"strategy": "cpu_rows", "lanes": 16}, {"variance": "two_pass"},
     True),
])
def test_only_templates_that_replay_are_exported(tmp_path, case, target, knobs, options, exported):
    task = task_of(case, target, **options)
    log = tmp_path / "log.jsonl"
    append_record(log, task.func, target, task.name, knobs, 7.0)
    result = export_metaschedule(log, [task], target, tmp_path / "ms")
    if not exported:
        assert result["exported"] == {} and knobs["strategy"] in result["skipped"][task.key]["reason"]
        assert not (tmp_path / "ms" / "database_tuning_record.json").exists()
        return
    assert result["exported"] == {task.key: {"task": task.name, "us": 7.0}}, result["skipped"]
    got = stock_db(result).query_ir_module(workload_of(task.func), target, "main")
    assert tvm_ffi.structural_equal(got, ours(task, target, knobs))


def test_relax_apply_database_schedules_the_fused_function(tmp_path):
    """Stock Relax: MetaScheduleApplyDatabase finds our record for the fused function of the model."""
    task, knobs = task_of(RMS, LLVM), {"strategy": "cpu_rows", "lanes": 64}
    log = tmp_path / "log.jsonl"
    append_record(log, task.func, LLVM, task.name, knobs, 3.0)
    result = export_metaschedule(log, [task], LLVM, tmp_path / "ms")
    fused = fused_module(relax_module(*RMS), LLVM)
    with LLVM, stock_db(result):
        applied = relax.transform.MetaScheduleApplyDatabase()(fused)
    func = applied[task.name]
    assert func.attrs["tirx.is_scheduled"]
    scheduled = schedules.schedule(task.func, LLVM, knobs).mod["main"]
    assert tvm_ffi.structural_equal(func, scheduled.with_attr("tirx.is_scheduled", True))
    assert not tvm_ffi.structural_equal(func.without_attr("tirx.is_scheduled"), fused[task.name])


def test_a_kernel_the_trace_does_not_reproduce_is_skipped(tmp_path, monkeypatch):
    """A template that also edits the function (here: adds an attr, as the grid templates do) still
    has a trace that replays, but to a different kernel: it must not be exported as ours."""
    task, knobs = task_of(RMS, LLVM), {"strategy": "cpu_rows", "lanes": 16}
    real = schedules.schedule
    monkeypatch.setattr(schedules, "schedule", lambda func, target, k: real(func.with_attr("tvm_ext.zeroed_inputs", [
        ([64], "int32")]), target, k))
    log = tmp_path / "log.jsonl"
    append_record(log, task.func, LLVM, task.name, knobs, 7.0)
    result = export_metaschedule(log, [task], LLVM, tmp_path / "ms")
    assert result["exported"] == {}
    assert "does not give our kernel" in result["skipped"][task.key]["reason"]


def test_tasks_that_share_a_name_are_reported_apart(tmp_path):
    col, row = task_of(("col_sum", [4096, 1024], "float32"), CUDA), task_of(("row_sum", [64, 131072], "float32"), CUDA)
    assert col.name == row.name == "sum" and col.key != row.key
    log = tmp_path / "log.jsonl"
    append_record(log, col.func, CUDA, col.name, {"strategy": "column_reduce", "cols": 16, "lanes": 64}, 9.0)
    append_record(log, row.func, CUDA, row.name, {"strategy": "grid_reduce", "blocks_per_row": 32, "threads": 512,
                                                  "vec": 4}, 4.0)
    result = export_metaschedule(log, [col, row], CUDA, tmp_path / "ms")
    assert result["exported"] == {col.key: {"task": "sum", "us": 9.0}}
    assert list(result["skipped"]) == [row.key] and "trace is empty" in result["skipped"][row.key]["reason"]
    assert len(stock_db(result).get_all_tuning_records()) == 1
