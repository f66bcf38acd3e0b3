"""Measure every point of each case's search space on this GPU (the exhaustive reference).

    python -m bench.measure_spaces --out bench/results/space.json [--cases ID,...] [--hidden]

One row per point: knobs, latency samples or the error. The table is what the search is judged
against (bench.search_quality replays the tuner and random search over it), and --hidden adds
shapes outside the public suite, for the transfer bar. Resumable: cases already in --out are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tqdm import tqdm
from tvm.target import Target

import tvm_ext
from bench.suite import load_suite, relax_module
from tvm_ext.search.measure import Measurer
from tvm_ext.search.space import knob_space
from tvm_ext.search.tasks import extract_tasks

# Shapes the public suite does not have: the cost model must place them from the suite's log alone
HIDDEN = [
    {"id": "ln-12288x2048-f16", "op": "layer_norm", "shape": [12288, 2048], "dtype": "float16"},
    {"id": "ln-1024x16384-bf16", "op": "layer_norm", "shape": [1024, 16384], "dtype": "bfloat16"},
    {"id": "rms-16384x2048-bf16", "op": "rms_norm", "shape": [16384, 2048], "dtype": "bfloat16"},
    {"id": "rms-4096x6144-f16", "op": "rms_norm", "shape": [4096, 6144], "dtype": "float16"},
    {"id": "sm-16384x2048-f16", "op": "softmax", "shape": [16384, 2048], "dtype": "float16"},
    {"id": "sm-512x65536-f32", "op": "softmax", "shape": [512, 65536], "dtype": "float32"},
    {"id": "rowsum-256x65536-f32", "op": "row_sum", "shape": [256, 65536], "dtype": "float32"},
    {"id": "colsum-65536x2048-f32", "op": "col_sum", "shape": [65536, 2048], "dtype": "float32"},
]

CHUNK = 8  # points measured per call


def table_tasks(table: dict) -> tuple[Target, dict]:
    """A table's target and each case's task, rebuilt the way the table was measured."""
    target = Target(table["target"])
    return target, {cid: extract_tasks(relax_module(e["case"]["op"], e["case"]["shape"], e["case"]["dtype"]),
                                       target)[0] for cid, e in table["cases"].items()}


def measured(entry: dict) -> tuple[list, np.ndarray]:
    """Knobs and best latency of each point of a case that measured without error."""
    good = [r for r in entry["points"] if r["error"] is None]
    return [r["knobs"] for r in good], np.array([min(r["us"]) for r in good])


def cases(ids: str, hidden: bool) -> list[dict]:
    every = load_suite() + (HIDDEN if hidden else [])
    return [c for c in every if not ids or c["id"] in ids.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="")
    ap.add_argument("--hidden", action="store_true", help="also the shapes outside the public suite")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds a candidate may take to build or run")
    args = ap.parse_args(argv)
    target = tvm_ext.parse_target(args.target)
    table = json.load(open(args.out)) if os.path.exists(args.out) else {"target": str(target), "cases": {}}
    with Measurer(target, timeout=args.timeout) as measurer:
        table["copy_gbps"] = measurer.copy_gbps()
        for case in cases(args.cases, args.hidden):
            if case["id"] in table["cases"]:
                continue
            (task,) = extract_tasks(relax_module(case["op"], case["shape"], case["dtype"]), target)
            points = knob_space(task.func, target)
            start = time.monotonic()
            results = []
            with tqdm(total=len(points), desc=case["id"]) as bar:
                for first in range(0, len(points), CHUNK):  # in chunks: progress, and errors as they come
                    results += measurer.measure(task.func, points[first:first + CHUNK])
                    bar.update(len(results) - bar.n)
                    for r in results[first:]:
                        if r.error:
                            bar.write(f"{case['id']} {r.knobs}: {r.error}")
            table["cases"][case["id"]] = {"case": case, "key": task.key, "hidden": case in HIDDEN,
                                          "seconds": time.monotonic() - start,
                                          "points": [{"knobs": r.knobs, "us": r.us, "error": r.error} for r in results]}
            good = [r.best_us for r in results if r.error is None]
            print(f"{case['id']}: {len(points)} points, {len(good)} ok, best {min(good, default=float('nan')):.1f} us, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
            with open(args.out + ".tmp", "w") as f:
                json.dump(table, f)
            os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
