"""Where a whole model's microseconds go, ours against torch.compile, on one GPU in one process.

    python -m bench.timeline --models llama-seq512,bert-seq128 --out bench/results/NAME [--rounds 5]

Implementations: ours, ours built without programmatic dependent launch (`ours_serial_launch`:
each kernel waits for the one before it to retire, tvm_ext/tir/dependent_launch.py) and
torch.compile. For each model and implementation: the median of `triton.testing.do_bench` (L2
flushed before each call, as bench/e2e.py times) over `--rounds` rounds in which the
implementations take turns (torch.compile's time moves between runs of one process by more than
the differences measured), the mean of 20 calls back to back, and one call's GPU timeline
(torch.profiler, after an L2 flush): its span from the first kernel's start to the last one's end,
the sum of its kernel times, the idle gaps between kernels, each kernel, and the host time to
enqueue the call (the last of three: the profiler slows the first ones). A kernel-time sum averaged
over many calls (bench/e2e.py's breakdown) can differ from one call's, which is why this looks at
single calls. Writes NAME.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import tvm  # noqa: F401  import TVM before torch (see the field guide)
import tvm_ext

import torch  # noqa: E402  pylint: disable=wrong-import-order

from bench.e2e import build_serial_launch
from bench.run import time_us, tvm_callable
from examples.torch_models import make

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(work) -> list[dict]:
    """The GPU events (kernels, copies, memsets) of running `work()`, in time order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])


def one_call(fn, x, flush, calls: int = 3) -> dict:
    """The last of `calls` calls of `fn`, each after an L2 flush, as the profiler sees it on the GPU
    (the first calls under a profiler start slower, with host-bound gaps)."""
    flush_kernels = {e["name"] for e in gpu_events(flush.zero_)}
    host_us = []

    def work():
        for _ in range(calls):
            flush.zero_()
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn(x)
            host_us.append((time.perf_counter() - started) * 1e6)
            torch.cuda.synchronize()

    events = gpu_events(work)
    last_flush = max(i for i, e in enumerate(events) if e["name"] in flush_kernels)
    events = events[last_flush + 1:]
    gaps = [later["ts"] - (earlier["ts"] + earlier["dur"]) for earlier, later in zip(events, events[1:])]
    return {"span_us": round(events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"], 1),
            "kernel_sum_us": round(sum(e["dur"] for e in events), 1), "gaps_us": round(sum(gaps), 1),
            "largest_gap_us": round(max(gaps, default=0.0), 1), "host_enqueue_us": round(host_us[-1], 1),
            "kernels": [(e["name"][:60], round(e["dur"], 1)) for e in events]}


def back_to_back_us(fn, x, calls: int = 20) -> float:
    fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-seq512")
    parser.add_argument("--out", required=True, help="path without extension; NAME.json is written")
    parser.add_argument("--rounds", type=int, default=1, help="timing rounds, the implementations taking turns")
    args = parser.parse_args(argv)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than the L2
    results = {}
    for name in args.models.split(","):
        module, x = make(name)
        mod = tvm_ext.from_torch(copy.deepcopy(module), x)
        module, x = module.cuda(), x.cuda()
        with torch.no_grad():
            impls = {"ours": tvm_callable(tvm_ext.build(mod, "cuda")),
                     "ours_serial_launch": tvm_callable(build_serial_launch(mod, "cuda")),
                     "torch_compile": torch.compile(module, dynamic=False)}
            rounds = [{impl: time_us(fn, [x]) for impl, fn in impls.items()} for _ in range(args.rounds)]
            results[name] = {impl: {"do_bench_us": statistics.median(r[impl] for r in rounds),
                                    "rounds_us": [round(r[impl], 1) for r in rounds],
                                    "back_to_back_us": back_to_back_us(fn, x), "one_call": one_call(fn, x, flush)}
                             for impl, fn in impls.items()}
        for impl, r in results[name].items():
            print(name, impl, {k: v for k, v in r["one_call"].items() if k != "kernels"}, f"do_bench {r['do_bench_us']:.1f}",
                  r["rounds_us"])
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
