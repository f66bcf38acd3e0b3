"""Judge the search on a measured space table (bench.measure_spaces): no GPU needed to replay.

    python -m bench.search_quality --table bench/results/space.json --out bench/results/search-quality

For each case the tuner (model-guided, epsilon 0.25, batches of 8) and random search are replayed
over the measured points, 10 seeds each, and compared with the exhaustive best: best-so-far after
each trial (the curves, plotted), the ratio at 64 trials, and the trials the tuner's early stop
uses. Transfer: a model trained on the public cases' measurements (or, with `--train-logs`, a
committee of `--members` models trained on tuning logs such as the shipped `tuning_logs/*.json`,
as `ModelDatabase` trains it) picks, with 0 trials, a point for each hidden shape among those the
table measured; that point's latency is compared with what 64 trials find.

    python -m bench.search_quality --table T.json --out NAME --train-logs tuning_logs/h200-*.json [--transfer-only]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

from bench.measure_spaces import measured, table_tasks
from bench.report import write_json_and_markdown
from tvm_ext.search.cost_model import COMMITTEE, Committee, CostModel, logged_groups, trainable
from tvm_ext.search.features import candidate_features
from tvm_ext.search.measure import Result
from tvm_ext.search.scheduler import each_batch, tune
from tvm_ext.search.strategy import TaskSearch
from tvm_ext.records import read_records
from tvm_ext.search.space import knob_space

SEEDS, TRIALS = 10, 64


def _key(knobs: dict) -> str:
    return json.dumps(knobs, sort_keys=True)


def _oracle(rows: list[dict]):
    table = {_key(r["knobs"]): r for r in rows}

    def measure(func, candidates, dims, on_result=None):
        # a point of today's space that an older table lacks counts as a failed trial
        return [Result(k, table[_key(k)]["us"] or [], table[_key(k)]["error"]) if _key(k) in table
                else Result(k, [], "not measured in the table") for k in candidates]
    return measure


def _search(task, target, rows, epsilon, seed, patience, log) -> TaskSearch:
    search = TaskSearch(task, target, log, TRIALS, batch=8, epsilon=epsilon, patience=patience, seed=seed)
    tune([search], each_batch(_oracle(rows)), TRIALS, progress=False)
    return search


def _curve(search: TaskSearch, best: float) -> list[float]:
    curve = [c / best for c in search.curve()]
    return curve + [curve[-1]] * (TRIALS - len(curve))  # a search that ran out of points stays where it ended


def _pick(model: CostModel | Committee, func, target, rows: list[dict], strategies=None) -> tuple[dict | None, float]:
    """The point `model` ranks first among those of today's space that the table measured (it can
    judge no other; a table older than a knob space lacks the newer points) and of `strategies`
    where given (ModelDatabase ranks only its logs' templates), and its latency; (None, nan)
    where no such point is left (ModelDatabase leaves the task to the heuristic)."""
    space = {_key(p) for p in knob_space(func, target)}
    good = [r for r in rows if r["error"] is None and _key(r["knobs"]) in space
            and (strategies is None or r["knobs"].get("strategy") in strategies)]
    if not good:
        return None, float("nan")
    best = int(np.argmax(model.score(candidate_features(func, [r["knobs"] for r in good], target))))
    return good[best]["knobs"], min(good[best]["us"])


def judge(table: dict, train_logs=(), transfer_only: bool = False, members: int = COMMITTEE) -> dict:
    target, tasks = table_tasks(table)
    out = {"cases": {}, "transfer": {}}
    with tempfile.TemporaryDirectory() as tmp:
        log = f"{tmp}/replay.json"
        for cid, entry in ([] if transfer_only else table["cases"].items()):
            task, rows = tasks[cid], entry["points"]
            best = float(measured(entry)[1].min())
            curves = {name: [_curve(_search(task, target, rows, eps, seed, 10**6, log), best) for seed in range(SEEDS)]
                      for name, eps in (("ours", 0.25), ("random", 1.0))}
            stopped = [_search(task, target, rows, 0.25, seed, 3, log) for seed in range(SEEDS)]
            out["cases"][cid] = {
                "points": len(rows), "exhaustive_us": best, "hidden": bool(entry.get("hidden")),
                "ours_at_64": float(np.mean([cv[-1] for cv in curves["ours"]])),
                "ours_worst_at_64": float(np.max([cv[-1] for cv in curves["ours"]])),
                "random_at_64": float(np.mean([cv[-1] for cv in curves["random"]])),
                "early_stop_trials": float(np.mean([len(s.measured) for s in stopped])),
                "early_stop_ratio": float(np.mean([s.best_us / best for s in stopped])),
                "curves": {name: np.median(cv, axis=0).tolist() for name, cv in curves.items()}}
            print(f"{cid}: {len(rows)} points; at 64 trials ours {out['cases'][cid]['ours_at_64']:.3f}x of best "
                  f"(worst seed {out['cases'][cid]['ours_worst_at_64']:.3f}), random {out['cases'][cid]['random_at_64']:.3f}",
                  flush=True)
        public = [cid for cid, e in table["cases"].items() if not e.get("hidden")]
        strategies = None
        if train_logs:
            records = [rec for path in train_logs for rec in read_records(path)]
            model = Committee(members).fit(logged_groups(records))  # as ModelDatabase trains it
            strategies = {rec["knobs"].get("strategy") for rec in records if trainable(rec)}
        else:
            model = CostModel().fit([(candidate_features(tasks[other].func, points, target), us)
                                     for other in public for points, us in [measured(table["cases"][other])]])
        for cid, entry in table["cases"].items():
            if not entry.get("hidden"):
                continue
            pick, pick_us = _pick(model, tasks[cid].func, target, entry["points"], strategies)
            tuned = float(np.mean([_search(tasks[cid], target, entry["points"], 0.25, s, 10**6, log).best_us
                                   for s in range(SEEDS)]))
            out["transfer"][cid] = {"pick": pick, "pick_us": pick_us, "tuned_64_us": tuned, "ratio": pick_us / tuned}
            print(f"transfer {cid}: 0 trials {pick_us:.1f} us vs 64 trials {tuned:.1f} us ({pick_us / tuned:.3f}x)",
                  flush=True)
    return out


def markdown(result: dict) -> str:
    lines = []
    if result["cases"]:
        lines += ["| case | points | exhaustive us | ours @64 (mean / worst of 10 seeds) | random @64 | early stop: trials, ratio |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {cid}{' (hidden)' if r['hidden'] else ''} | {r['points']} | {r['exhaustive_us']:.1f} | "
                  f"{r['ours_at_64']:.3f} / {r['ours_worst_at_64']:.3f} | {r['random_at_64']:.3f} | "
                  f"{r['early_stop_trials']:.0f}, {r['early_stop_ratio']:.3f} |" for cid, r in result["cases"].items()]
        lines.append("")
    lines += ["| hidden case | 0-trial pick us | 64-trial us | ratio |", "|---|---|---|---|"]
    lines += [f"| {cid} | {t['pick_us']:.1f} | {t['tuned_64_us']:.1f} | {t['ratio']:.3f} |"
              for cid, t in result["transfer"].items()]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415  (bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [cid for cid, r in result["cases"].items() if r["points"] > 8]
    cols = 4
    fig, axes = plt.subplots((len(names) + cols - 1) // cols, cols, figsize=(16, 3 * ((len(names) + cols - 1) // cols)),
                             squeeze=False)
    for ax, cid in zip(axes.flat, names):
        for name, style in (("ours", "-"), ("random", "--")):
            curve = result["cases"][cid]["curves"][name]
            ax.plot(range(1, len(curve) + 1), curve, style, label=name)
        ax.set_title(cid, fontsize=9)
        ax.set_ylim(0.98, min(2.0, max(result["cases"][cid]["curves"]["random"][7:] + [1.1])))
        ax.axhline(1.03, color="grey", lw=0.5)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.supxlabel("trials")
    fig.supylabel("best so far / exhaustive best (median of 10 seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--out", required=True, help="path prefix: writes .json, .md and .png")
    ap.add_argument("--train-logs", nargs="*", default=[], help="tuning logs the transfer model is trained on "
                    "(default: the table's public cases)")
    ap.add_argument("--transfer-only", action="store_true", help="judge only the 0-trial picks of the hidden cases")
    ap.add_argument("--members", type=int, default=COMMITTEE, help="cost models of the committee trained on --train-logs")
    args = ap.parse_args(argv)
    with open(args.table, encoding="utf-8") as f:
        result = judge(json.load(f), args.train_logs, args.transfer_only, args.members)
    write_json_and_markdown(args.out, result, markdown(result))
    if result["cases"]:
        plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
