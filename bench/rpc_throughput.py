"""Candidates measured per minute through one TVM RPC server and through several, on this machine.

    python -m bench.rpc_throughput --cases grid --target llvm --trials 1000 --servers 1,2 --server-cpus 4 \\
        --out bench/results/NAME

For each server count a tracker and that many servers are started on 127.0.0.1 (llvm servers each
pinned to `--server-cpus` CPUs of whole physical cores of their own, with as many TVM threads; the
builders get the cores left after the most servers, the same in every run), the cases are tuned
through them from an empty log, and the run's wall time and candidates
per minute (first to last record) are written as NAME.json and NAME.md. Cases are OP:ROWSxCOLS:DTYPE
(bench.suite's ops), CI-sized by default: a CPU candidate of a suite-sized case runs for a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import datetime

from bench.report import write_json_and_markdown
from bench.suite import relax_module
from tvm_ext.search.local_cluster import local_cluster
from tvm_ext.search.tuner import tune_model


def _per_minute(log: str) -> tuple[int, float, int]:
    """(records, candidates per minute from the first record to the last, errors) of a log."""
    lines = [json.loads(line) for line in open(log, encoding="utf-8") if line.strip()]
    stamps = sorted(datetime.fromisoformat(line["time"]).timestamp() for line in lines)
    span = max(1e-3, stamps[-1] - stamps[0]) if stamps else 1.0
    return len(lines), 60.0 * (len(lines) - 1) / span if lines else 0.0, sum(line.get("error") is not None for line in lines)


CASES = "layer_norm:2048x1024:float32,softmax:4096x1000:float32,rms_norm:4096x768:float32,row_sum:8192x512:float32"
# `--cases grid`: 120 CI-sized tasks of 3 points each, enough candidates that the first ones' wait
# for their references and the builders' start does not set the rate
GRID = ",".join(f"{op}:{rows}x{cols}:float32" for op in ("layer_norm", "softmax", "rms_norm", "row_sum")
                for rows in (256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 2048) for cols in (256, 512, 1024))


def physical_cores(cpus: list[int], topology: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """`cpus` grouped by the physical core they run on (hyperthread siblings together, in order of
    their first CPU); each CPU its own group where the topology cannot be read."""
    cores: dict = {}
    for cpu in cpus:
        try:
            with open(f"{topology}/cpu{cpu}/topology/thread_siblings_list", encoding="utf-8") as f:
                core = f.read().strip()
        except OSError:
            core = str(cpu)
        cores.setdefault(core, []).append(cpu)
    return list(cores.values())


def pin(cpus: list[int], servers: int, per_server: int, topology: str = "/sys/devices/system/cpu") -> tuple[list, list]:
    """([CPUs of each server], builders' CPUs): each server takes whole physical cores until it has
    `per_server` CPUs, so that no two servers, nor a server and a builder, share a core (siblings
    share its pipelines and caches: one server's timings would feel the other's work)."""
    cores, pinned = physical_cores(cpus, topology), []
    for _ in range(servers):
        mine = []
        while cores and len(mine) < per_server:
            mine += cores.pop(0)
        pinned.append(mine)
    return pinned, [cpu for core in cores for cpu in core]


def module(case: str):
    """The Relax module of OP:ROWSxCOLS:DTYPE."""
    op, shape, dtype = case.split(":")
    return relax_module(op, [int(n) for n in shape.split("x")], dtype)


def run(cases: list, target: str, trials: int, counts: list[int], server_cpus: int) -> dict:
    mods = [module(case) for case in cases]
    cpus = sorted(os.sched_getaffinity(0))
    rows = []
    layout, free = pin(cpus, max(counts), server_cpus)
    for count in counts:
        pinned = layout[:count] if target == "llvm" else None
        builder_cpus = free if pinned else cpus  # the same builders in every run
        env = {"TVM_NUM_THREADS": str(server_cpus)} if pinned else None
        with tempfile.TemporaryDirectory() as tmp, local_cluster(count, f"bench{count}", env=env, cpus=pinned) as (tracker, _):
            log = os.path.join(tmp, "log.json")
            os.sched_setaffinity(0, builder_cpus)
            started = time.monotonic()
            try:
                tune_model(mods, target, trials, log, builders=len(builder_cpus), rpc=(tracker, f"bench{count}"), progress=False)
            finally:
                os.sched_setaffinity(0, cpus)
            wall = time.monotonic() - started
            records, per_minute, errors = _per_minute(log)
        rows.append({"servers": count, "wall_s": wall, "records": records, "errors": errors, "per_minute": per_minute,
                     "builders": len(builder_cpus), "server_cpus": server_cpus if pinned else None,
                     "pinned": pinned, "builder_cpu_list": builder_cpus})
        print(rows[-1], flush=True)
    return {"cases": cases, "target": target, "trials": trials, "rows": rows}


def markdown(result: dict) -> str:
    one = result["rows"][0]["per_minute"] or 1.0
    lines = [f"Tuning {', '.join(result['cases'])} on `{result['target']}`, {result['trials']} trials, through TVM RPC "
             "servers on this machine.", "",
             "| servers | wall (s) | records | errors | candidates/min | vs the first row | builders | CPUs a server |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['servers']} | {r['wall_s']:.1f} | {r['records']} | {r['errors']} | {r['per_minute']:.1f} | "
              f"{r['per_minute'] / one:.2f}x | {r['builders']} | {r['server_cpus'] or '-'} |" for r in result["rows"]]
    last = result["rows"][-1]
    if last.get("pinned"):
        lines += ["", f"Servers on CPUs {last['pinned']} (whole cores), builders on {last['builder_cpu_list']}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="comma-separated OP:ROWSxCOLS:DTYPE, or `grid` (120 tasks)")
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--servers", default="1,2", help="server counts, one run each")
    ap.add_argument("--server-cpus", type=int, default=4, help="CPUs (and TVM threads) of each llvm server")
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.servers.split(",")]
    if args.target == "llvm" and not pin(sorted(os.sched_getaffinity(0)), max(counts), args.server_cpus)[1]:
        ap.error(f"{max(counts)} servers of {args.server_cpus} CPUs (whole cores) leave no CPU to the builders")
    cases = GRID if args.cases == "grid" else args.cases
    result = run(cases.split(","), args.target, args.trials, counts, args.server_cpus)
    write_json_and_markdown(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
