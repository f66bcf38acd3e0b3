"""Re-check tuning logs on this machine: every measured record's candidate rebuilt, checked against
the reference and timed again with the local runner.

    python -m bench.recheck --model torch:llama-seq512 --target cuda LOG [LOG ...] [--out FILE]

A log written through RPC servers (or another process) is only as good as that measurement; this
runs each record's knobs again here and says which fail the check and how the latency compares.
Exits 1 when a record that the log calls good fails here.
"""

from __future__ import annotations

import argparse
import json
import statistics

from tvm_ext.records import read_records
from tvm_ext.search.cli import load_model, measuring_target, parse_dims
from tvm_ext.search.measure import Measurer
from tvm_ext.search.tasks import extract_tasks


def recheck(log: str, tasks: dict, measurer: Measurer, dims: dict) -> dict:
    """{records, failed: [(task, knobs, error)], ratios: [re-timed / logged]} for one log."""
    good = [rec for rec in read_records(log) if rec.get("error") is None]
    failed, ratios, foreign = [], [], 0
    for key in sorted({rec["key"] for rec in good}):
        if key not in tasks:  # a record of another model or pipeline: nothing here to rebuild it from
            foreign += sum(rec["key"] == key for rec in good)
            continue
        mine = [rec for rec in good if rec["key"] == key]
        for rec, result in zip(mine, measurer.measure(tasks[key].func, [rec["knobs"] for rec in mine], dims)):
            if result.error is not None:
                failed.append((rec["task"], rec["knobs"], result.error.splitlines()[0]))
            else:
                ratios.append(result.best_us / rec["us"])
    return {"records": len(good), "foreign": foreign, "failed": failed, "ratios": ratios}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--model", required=True, help="as tune.py's --model")
    ap.add_argument("--target", default="cuda", help="as tune.py's --target")
    ap.add_argument("--dims", default="", help="as tune.py's --dims (the values the logs were measured at)")
    ap.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    target = measuring_target(args.target)
    tasks = {task.key: task for task in extract_tasks(load_model(args.model), target)}
    summary = {}
    with Measurer(target) as measurer:
        for log in args.logs:
            found = summary[log] = recheck(log, tasks, measurer, parse_dims(args.dims))
            ratios = found["ratios"]
            print(f"{log}: {found['records']} good records, {len(ratios)} re-checked and passed, "
                  f"{len(found['failed'])} failed, {found['foreign']} not of this model"
                  + (f"; re-timed / logged latency median {statistics.median(ratios):.3f} "
                     f"(min {min(ratios):.3f}, max {max(ratios):.3f})" if ratios else ""))
            for task, knobs, error in found["failed"]:
                print(f"  FAILED {task} {json.dumps(knobs, sort_keys=True)}: {error}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 1 if any(found["failed"] for found in summary.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
