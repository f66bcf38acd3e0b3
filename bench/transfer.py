"""Transfer to shapes no log measured, on this GPU: the shipped logs' 0-trial pick against tuning.

    python -m bench.transfer --train-logs tuning_logs/h200-*.json --trials 64 --out bench/results/NAME

For each hidden shape (bench.measure_spaces.HIDDEN) the cost model trained on the logs picks a
point with 0 trials, as `ModelDatabase` answers a user's build; the tuner then searches the shape
from an empty log for `--trials` candidates (its log kept in NAME-logs/). The pick, the tuned best
and the heuristic's point are timed again side by side in one Measurer (each checked against the
reference); what a build gets with 0 trials (the pick, or the heuristic's point where the model
has none) over the tuned time is written as NAME.json and NAME.md (within 10% is the bar).
"""

from __future__ import annotations

import argparse
import os

import tvm_ext
from bench.measure_spaces import HIDDEN
from bench.report import write_json_and_markdown
from bench.suite import relax_module
from tvm_ext import schedules
from tvm_ext.records import read_records
from tvm_ext.search.measure import Measurer
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.transfer import ModelDatabase
from tvm_ext.search.tuner import tune_model

BAR = 1.10  # a pick within 10% of what the trials find


def tuned_best(log: str) -> dict | None:
    """Knobs of the fastest error-free record of a one-task log."""
    good = [rec for rec in read_records(log) if rec.get("error") is None and rec.get("us")]
    return min(good, key=lambda rec: rec["us"])["knobs"] if good else None


def row(case_id: str, points: dict, us: dict) -> dict:
    """One case's line: `points` and `us` keyed pick, tuned, heuristic (us None where it failed).
    What a build gets with 0 trials is the model's pick, or the heuristic's point where the model
    has none (ModelDatabase.lookup answers None)."""
    zero = us.get("pick") if points.get("pick") else us.get("heuristic")
    ratio = zero / us["tuned"] if zero and us.get("tuned") else None
    return {"case": case_id, "knobs": points, "us": us, "zero_trial_us": zero, "ratio": ratio}


def run(cases: list[dict], target, train_logs: list[str], trials: int, logs_dir: str, on_row=None) -> dict:
    """Each case's tuning log is kept in `logs_dir` (data to judge other 0-trial policies by);
    `on_row(result so far)` after each case (a long run keeps what it measured)."""
    database = ModelDatabase.load(train_logs)
    rows = []
    result = {"target": str(target), "train_logs": [os.path.basename(p) for p in train_logs], "trials": trials,
              "rows": rows}
    for case in cases:
        mod = relax_module(case["op"], case["shape"], case["dtype"])
        (task,) = extract_tasks(mod, target)
        pick = database.lookup(task.func, target)
        log = os.path.join(logs_dir, f"{case['id']}.json")
        tune_model(mod, target, trials, log, resume=os.path.exists(log), progress=False)
        points = {"pick": pick, "tuned": tuned_best(log), "heuristic": schedules.heuristic_knobs(task.func, target)}
        named = [(name, knobs) for name, knobs in points.items() if knobs]
        with Measurer(target) as measurer:
            results = measurer.measure(task.func, [knobs for _, knobs in named])
        us = {name: (r.best_us if r.error is None else None) for (name, _), r in zip(named, results)}
        rows.append(row(case["id"], points, us))
        print(f"{case['id']}: 0 trials {rows[-1]['zero_trial_us']} us, {trials} trials {us.get('tuned')} us, "
              f"heuristic {us.get('heuristic')} us", flush=True)
        if on_row:
            on_row(result)
    return result


def _us(value) -> str:
    return "error" if value is None else f"{value:.1f}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.3f}x"


def markdown(result: dict) -> str:
    rows = result["rows"]
    within = sum(1 for r in rows if r["ratio"] is not None and r["ratio"] <= BAR)
    lines = [f"0-trial picks of a cost model trained on {', '.join(result['train_logs'])} against {result['trials']} "
             f"trials of tuning, on shapes none of the logs measured; times re-measured side by side.", "",
             f"| case | 0-trial us | {result['trials']} trials us | heuristic us | 0 trials / tuned | pick |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {_us(r['zero_trial_us'])} | {_us(r['us'].get('tuned'))} | {_us(r['us'].get('heuristic'))} "
              f"| {_ratio(r['ratio'])} | `{r['knobs']['pick'] or 'none: the heuristic'}` |" for r in rows]
    lines += ["", f"{within} of {len(rows)} picks within {BAR - 1:.0%} of the tuned time."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-logs", nargs="+", required=True, help="tuning logs the cost model is trained on")
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--cases", default="", help="comma-separated ids of bench.measure_spaces.HIDDEN (default all)")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md; the tuning logs go to OUT-logs/")
    args = ap.parse_args(argv)
    os.makedirs(args.out + "-logs", exist_ok=True)
    cases = [c for c in HIDDEN if not args.cases or c["id"] in args.cases.split(",")]
    run(cases, tvm_ext.parse_target(args.target), args.train_logs, args.trials, args.out + "-logs",
        on_row=lambda result: write_json_and_markdown(args.out, result, markdown(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
