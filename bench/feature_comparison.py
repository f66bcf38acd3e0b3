"""Which features predict better on tasks the model has not seen: ours or TVM's per-store ones?

    python -m bench.feature_comparison --table bench/results/h200-2026-11-21-space.json --out PREFIX

Uses a measured space table (bench.measure_spaces): for every case, every point gets our
hand-made features (search/features.py: knobs, shape, device) and MetaSchedule's `PerStoreFeature`
of the scheduled TIR (per buffer store, pooled by mean and max over stores to one vector). Leaving
one case out at a time, an XGBoost ranker trained on the others scores the held-out case's points:
reported are the rank correlation with the measured latencies and the latency of the top-scored
point over the best (what a 0-trial transfer would get).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from tvm_ext import schedules
from bench.measure_spaces import measured, table_tasks
from bench.report import table_cli
from tvm_ext.search.cost_model import CostModel
from tvm_ext.search.features import candidate_features


def per_store_features(func, target, points) -> np.ndarray:
    context = ms.TuneContext(tvm.IRModule({"main": func}), target=target, num_threads=1)
    extractor = ms.feature_extractor.PerStoreFeature()
    rows = []
    for knobs in points:
        sch = schedules.schedule(func, target, knobs)
        (feats,) = extractor.extract_from(context, [ms.MeasureCandidate(sch, ArgInfo.from_prim_func(func))])
        f = feats.numpy()
        rows.append(np.concatenate([f.mean(0), f.max(0)]) if len(f) else np.zeros(2 * 164))
    return np.asarray(rows, dtype="float32")


def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def compare(table: dict) -> dict:
    target, tasks = table_tasks(table)
    data = {}
    for cid, entry in table["cases"].items():
        points, us = measured(entry)
        data[cid] = {"us": us, "ours": candidate_features(tasks[cid].func, points, target),
                     "per_store": per_store_features(tasks[cid].func, target, points)}
        print(f"{cid}: {len(points)} points featurised", flush=True)
    out = {}
    for kind in ("ours", "per_store"):
        out[kind] = {}
        for held in data:
            model = CostModel().fit([(d[kind], d["us"]) for cid, d in data.items() if cid != held])
            score, us = model.score(data[held][kind]), data[held]["us"]
            out[kind][held] = {"spearman": _spearman(score, -us), "top1_over_best": float(us[np.argmax(score)] / us.min())}
    return out


def markdown(result: dict) -> str:
    lines = ["| held-out case | ours: rank corr. | ours: top-1 / best | per-store: rank corr. | per-store: top-1 / best |",
             "|---|---|---|---|---|"]
    for cid in result["ours"]:
        o, p = result["ours"][cid], result["per_store"][cid]
        lines.append(f"| {cid} | {o['spearman']:.2f} | {o['top1_over_best']:.3f} | {p['spearman']:.2f} | {p['top1_over_best']:.3f} |")
    for kind in ("ours", "per_store"):
        r = result[kind].values()
        lines.append(f"| mean ({kind}) | {np.mean([x['spearman'] for x in r]):.2f} | "
                     f"{np.exp(np.mean([np.log(x['top1_over_best']) for x in r])):.3f} (geomean) | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    table_cli(argv, __doc__, compare, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
