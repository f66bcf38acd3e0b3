"""Task extraction: a model's fused reduce subgraphs (on GPUs also matmuls and convolutions), keyed and weighted.

A task is one fused PrimFunc as the pipeline schedules it, keyed as in the tuning log
(`tvm_ext.records.task_key`), so functions of the same structure are one task weighted by their
call sites."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.target import Target

from tvm_ext.schedules.analysis import is_reduce_subgraph
from tvm_ext.schedules import contraction_template, tunable
from tvm_ext.pipeline import fused_variants
from tvm_ext.records import task_key
from tvm_ext.relax.bindings import CALL_TIR
from tvm_ext.target import parse_target


@dataclass(frozen=True)
class Task:
    name: str  # the first fused function with this key
    key: str
    func: tirx.PrimFunc
    weight: int  # call sites in the model, over every function with this key


def _call_counts(mod: tvm.IRModule) -> dict:
    counts: dict = {}

    def visit(call):
        if isinstance(call.op, tvm.ir.Op) and call.op.same_as(CALL_TIR):
            counts[call.args[0].name_hint] = counts.get(call.args[0].name_hint, 0) + 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func.body, (relax.Call, visit), order="pre")
    return counts


def extract_tasks(mods, target, **options) -> list[Task]:
    """The tasks of `mods` (one IRModule or a list of them, e.g. a suite) on `target`, heaviest
    first (then by name); with `variance="tuned"`, the functions of every variant the build
    chooses among (pipeline.fused_variants)."""
    target = target if isinstance(target, Target) else parse_target(target)
    gpu = "gpu" in target.keys  # where matmuls and convolutions are ours too (GPU templates)
    tasks: dict = {}
    for mod in mods if isinstance(mods, (list, tuple)) else [mods]:
        counted = set()  # keys whose call sites in `mod` are counted (in its first variant that has them)
        for fused in fused_variants(mod, target, **options):
            counts = _call_counts(fused)
            for gv, func in sorted(fused.functions_items(), key=lambda item: item[0].name_hint):
                if not isinstance(func, tirx.PrimFunc):
                    continue
                if not (is_reduce_subgraph(func) and tunable(func, target)
                        or gpu and contraction_template(func, target) is not None):
                    continue  # a symbolic row width's classes are chosen per call: not one task
                key = task_key(func, target)
                first = tasks.get(key)
                weight = (0 if key in counted else counts.get(gv.name_hint, 0)) + (first.weight if first else 0)
                counted.add(key)
                tasks[key] = Task(first.name if first else gv.name_hint, key, first.func if first else func, weight)
    return sorted(tasks.values(), key=lambda t: (-t.weight, t.name))
