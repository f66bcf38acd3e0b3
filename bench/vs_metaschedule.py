"""Tune the suite's fused functions with stock MetaSchedule, to compare with our tuner.

    python -m bench.vs_metaschedule --cases sm-8192x4096-f16,rms-8192x4096-bf16 --trials 1000 --out ms_out/ \
        [--target '{"tag": "nvidia/nvidia-h100", "arch": "sm_90"}'] [--suite bench/suite.json]

Each case's tasks are the PrimFuncs our tuner sees (`search.tasks.extract_tasks`), so both tuners
schedule the same function. MetaSchedule is TVM 0.27's `tvm.s_tir.meta_schedule.tune_tir` with its
defaults: evolutionary search guided by the XGBoost cost model ("xgb": `XGBModel`, trained on
`PerStoreFeature` features; random scores until 100 measurements, its `num_warmup_samples`), local
builder and runner. Writes `<out>/vs_metaschedule.json` with each task's tuning wall time and the
library compiled from the best record; our tuner runs on the same case, and both kernels are checked
and timed by our runner (`search.runner`). Needs `cloudpickle`, `psutil` and `xgboost`. Static shapes only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

import tvm_ext
from bench.suite import SUITE, load_suite, relax_module
from tvm_ext.search.measure import Measurer
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.tuner import tune_model
from tvm_ext.relax import welford
from tvm_ext.tir.intrinsics import import_tensor_intrinsics


def ms_target(target) -> Target:
    """`target` as MetaSchedule needs it: an LLVM target must say how many cores to parallelise over
    ("num-cores", else tune_tir fails), and a CUDA one its block limits (`tvm_ext.parse_target` and the
    nvidia tags carry them)."""
    target = tvm_ext.parse_target(target)
    if target.kind.name == "llvm" and target.attrs.get("num-cores", None) is None:
        target = Target({**target.export(), "num-cores": ms.utils.cpu_count(logical=False)})
    return target


def _prepare_builder_worker() -> None:
    """Run once in each builder process (MetaSchedule starts fresh ones for every batch), outside the
    30 s per-build timeout. `default_build` imports tvm.s_tir.tensor_intrin, which took 35 s on our CPU
    machine, so inside the timeout every build of a batch timed out and tune_tir measured nothing
    (`import_tensor_intrinsics` makes it ~5 s). The worker also needs our Welford reducers, as this
    process registered them when the task was extracted, to lower cross-thread reductions of them."""
    import_tensor_intrinsics()
    welford.register()


def tune_metaschedule(func: tvm.tirx.PrimFunc, target, trials: int, work_dir: str,
                      lib_path: str | None = None) -> tuple[float, tvm.IRModule | None]:
    """(wall seconds of tune_tir, the best scheduled IRModule or None when no candidate ran).

    The best record is compiled (`tvm.compile`, TVM's default pipelines) so that a schedule that does
    not build fails here, and exported to `lib_path` when given. The tuning log and MetaSchedule's
    own JSONDatabase stay in `work_dir`.
    """
    target = ms_target(target)
    os.makedirs(work_dir, exist_ok=True)  # JSONDatabase cannot create it
    builder = ms.builder.LocalBuilder(initializer=_prepare_builder_worker)
    start = time.perf_counter()
    database = ms.tune_tir(func, target, work_dir, max_trials_global=trials, num_trials_per_iter=min(trials, 64),
                           builder=builder)
    wall = time.perf_counter() - start
    sch = ms.tir_integration.compile_tir(database, func, target)
    if sch is None:
        return wall, None
    lib = tvm.compile(sch.mod, target=target)
    if lib_path is not None:
        lib.export_library(lib_path)
    return wall, sch.mod


def run_case(case: dict, target, trials: int, out: str, ours_trials: int) -> list[dict]:
    """Tune one suite case with MetaSchedule and with our tuner (`ours_trials`), time both kernels
    with our runner (same reference check, same L2-flushed timer); one row per task."""
    if any(isinstance(d, str) for d in case["shape"]):
        return [{"case": case["id"], "error": "symbolic shape: MetaSchedule tunes static shapes only"}]
    mod = relax_module(case["op"], case["shape"], case["dtype"])
    start = time.perf_counter()
    ours = {r.name: r for r in tune_model(mod, target, ours_trials, os.path.join(out, f"{case['id']}-ours.json"),
                                          progress=False)}
    ours_wall = time.perf_counter() - start
    rows = []
    for task in extract_tasks(mod, target):
        name = f"{case['id']}-{task.name}"
        lib = os.path.abspath(os.path.join(out, f"{name}.so"))
        wall, scheduled = tune_metaschedule(task.func, target, trials, os.path.join(out, "work", name), lib)
        row = {"case": case["id"], "task": task.name, "key": task.key, "trials": trials, "wall_s": round(wall, 3),
               "ours_trials": ours[task.name].trials, "ours_wall_s": round(ours_wall, 3),
               "ours_us": ours[task.name].best_us}
        if scheduled is None:
            row["error"] = "no MetaSchedule candidate built and ran"
        else:
            with Measurer(tvm_ext.parse_target(target)) as measurer:
                timed = measurer.time_library(task.func, lib)
            row.update({"lib": lib, "ms_us": timed.best_us, **({"error": timed.error} if timed.error else {})})
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", required=True, help="comma-separated suite ids")
    ap.add_argument("--trials", type=int, default=1000, help="MetaSchedule trials per task")
    ap.add_argument("--ours-trials", type=int, default=64, help="our tuner's trials per case")
    ap.add_argument("--out", required=True, help="folder for the libraries, work dirs and vs_metaschedule.json")
    ap.add_argument("--target", default="cuda", help="'cuda' (this GPU), 'llvm', or a target as JSON")
    ap.add_argument("--suite", default=SUITE)
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("search").setLevel(logging.INFO)  # our tuner's build/run time split
    target = json.loads(args.target) if args.target.startswith("{") else args.target
    suite = {c["id"]: c for c in load_suite(args.suite)}
    unknown = [i for i in args.cases.split(",") if i not in suite]
    if unknown:
        ap.error(f"unknown case id(s) {unknown}")
    os.makedirs(args.out, exist_ok=True)
    rows = [row for i in args.cases.split(",") for row in run_case(suite[i], target, args.trials, args.out, args.ours_trials)]
    report = os.path.join(args.out, "vs_metaschedule.json")
    with open(report, "w", encoding="utf-8") as f:
        json.dump({"tvm": tvm.__version__, "target": str(ms_target(target)), "results": rows}, f, indent=2)
    print(json.dumps(rows, indent=2))
    print(f"wrote {report}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
