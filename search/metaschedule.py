"""Export our tuning log as a MetaSchedule database, so stock TVM tools can read our results.

Our templates use schedule primitives, so a record's schedule carries a replayable trace. Grid
strategies (TVMScript kernels) and functions scheduled from a rewritten copy (Welford's pivot) do
not replay to our kernel; each record is replayed and compared first, and one that differs is
skipped with the reason."""

from __future__ import annotations

import os

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.database import JSONDatabase, MemoryDatabase, TuningRecord
from tvm.target import Target

from tvm_ext import schedules
from tvm_ext.records import Database
from tvm_ext.target import parse_target

# MetaSchedule's own normalisation (global_symbol "main" unless set, "tirx.noalias", IRModule({"main":
# func})): tune_tir, compile_tir and Relax's MetaScheduleApplyDatabase all key the database by it.
normalize_mod = tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")
WORKLOAD_NAME = "main"  # the name compile_tir queries under; the only function of a workload


def workload_of(func: tirx.PrimFunc) -> tvm.IRModule:
    """The IRModule MetaSchedule sees for `func`: a database lookup only finds a structurally equal one."""
    return normalize_mod(func)


def args_info(func: tirx.PrimFunc) -> list | None:
    """The arguments MetaSchedule would re-run the record with; None for symbolic shapes, which it
    cannot describe (ArgInfo wants constant dims)."""
    static = all(isinstance(d, tirx.IntImm) for p in func.params for d in p.shape)
    return ArgInfo.from_prim_func(func) if static else None


def replayed(record: TuningRecord, target: Target) -> tvm.IRModule | None:
    """What a stock database hands back for `record`: reloaded from its JSON (as JSONDatabase loads a
    file, replaying the trace on the workload) and queried for the workload."""
    db = MemoryDatabase()
    workload = db.commit_workload(record.workload.mod)
    db.commit_tuning_record(TuningRecord.from_json(record.as_json(), workload))
    return db.query_ir_module(workload.mod, target, WORKLOAD_NAME)


def tuning_record(func: tirx.PrimFunc, target: Target, knobs: dict, us: float) -> tuple[TuningRecord | None, str]:
    """(the MetaSchedule record of `knobs` on `func`, "") or (None, why it cannot be one).

    The record is kept only if replaying its trace reproduces our scheduled module exactly
    (structural_equal), so an exported record can never stand for a different kernel.
    """
    sch = schedules.schedule(func, target, knobs)
    if sch is None:
        return None, f"the template refuses knobs {knobs}"
    if sch.trace is None:
        return None, "the schedule recorded no trace"
    workload = workload_of(func)
    record = TuningRecord(sch.trace, ms.database.Workload(workload), run_secs=[us * 1e-6], target=target,
                          args_info=args_info(workload["main"]))
    try:
        got = replayed(record, target)
    except Exception as err:  # a trace that does not apply to the workload: TVMError, ValueError, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, (f"{knobs['strategy']}: the trace does not replay on the workload, so the template rewrote "
                      f"the function outside schedule primitives ({type(err).__name__}: {first[:120]})")
    if got is None:  # MetaSchedule drops a record without instructions as invalid (TuningRecord::IsValid)
        return None, (f"{knobs['strategy']}: the trace is empty: the template wrote a new function "
                      "instead of scheduling this one")
    if not tvm_ffi.structural_equal(got, normalize_mod(sch.mod["main"])):
        return None, (f"{knobs['strategy']}: replaying the trace on the workload does not give our kernel "
                      "(the template changes the function outside schedule primitives)")
    return record, ""


def export_metaschedule(log_path, tasks, target, out_dir) -> dict:
    """Write the best record of each task in our log to a MetaSchedule JSONDatabase in `out_dir`.

    Files: `database_workload.json` and `database_tuning_record.json`, appended to if present (as
    MetaSchedule itself does), written through JSONDatabase so that their format is TVM's.
    Returns {"exported": {task key: {"task": name, "us": us}}, "skipped": {task key: {"task": name,
    "reason": why}}, "workload": path, "tuning_record": path}; keyed by task key, since tasks of
    different structure may share a name (two `sum`s).
    """
    target = target if isinstance(target, Target) else parse_target(target)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"workload": os.path.join(out_dir, "database_workload.json"),
             "tuning_record": os.path.join(out_dir, "database_tuning_record.json")}
    best = Database.load(log_path).best  # failed measurements never count
    exported, skipped, records = {}, {}, []
    for task in tasks:
        if task.key not in best:
            skipped[task.key] = {"task": task.name, "reason": "no successful record in the log"}
            continue
        us, knobs, _ = best[task.key]
        record, reason = tuning_record(task.func, target, knobs, us)
        if record is None:
            skipped[task.key] = {"task": task.name, "reason": reason}
        else:
            records.append(record)
            exported[task.key] = {"task": task.name, "us": us}
    if records:  # JSONDatabase creates both files at construction: none when there is nothing to write
        db = JSONDatabase(path_workload=paths["workload"], path_tuning_record=paths["tuning_record"])
        for record in records:
            db.commit_tuning_record(TuningRecord(record.trace, db.commit_workload(record.workload.mod),
                                                 record.run_secs, record.target, record.args_info))
    return {"exported": exported, "skipped": skipped, **paths}
