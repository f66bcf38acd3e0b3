"""Time hand-listed knob variants of our schedules on this GPU (a manual search, to set heuristics).

    python -m bench.sweep --cases ln-8192x4096-f16,sm-49152x1024-f16 \
        --grid '{"strategy": ["block_row"], "threads": [64, 128, 256], "cache": [false, true]}'

Each variant is built through `tvm_ext.build(..., database=<a one-record log>)`, checked against
PyTorch eager, and timed like bench.run's device time; the heuristic's own choice is timed alongside.
A variant that is no point of its strategy's space is skipped with the reason (the build would
take the heuristic's schedule in its place).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile

import tvm  # before torch
import tvm_ext
from tvm_ext.pipeline import fused_reduce_functions
from tvm_ext.records import append_record

from tvm_ext import schedules  # noqa: E402
from tvm_ext.schedules.dispatch import knobs_problem  # noqa: E402
import torch  # noqa: E402

from bench.run import TORCH_DTYPE, flushed_device_us, max_err, torch_fn, tvm_callable  # noqa: E402
from bench.suite import effective_bytes, input_shapes, load_suite, relax_module  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True)
    ap.add_argument("--suite", default="bench/suite.json", help="the suite file the case ids are from")
    ap.add_argument("--grid", required=True, help="JSON: knob name -> list of values; variants are the product")
    ap.add_argument("--variance", default="welford", help="the variance algorithm the builds legalize with")
    args = ap.parse_args(argv)
    grid = json.loads(args.grid)
    target = tvm_ext.parse_target("cuda")
    wanted = args.cases.split(",")
    for case in [c for c in load_suite(args.suite) if c["id"] in wanted]:
        op, shape, dtype = case["op"], case["shape"], case["dtype"]
        mod = relax_module(op, shape, dtype)
        funcs = fused_reduce_functions(mod, target, variance=args.variance)
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = [(torch.randn(s, device="cuda", generator=gen) * 2 + 0.5).to(TORCH_DTYPE[dtype])
                  for s in input_shapes(op, shape)]
        ref = torch_fn(op)(*inputs)
        nbytes = effective_bytes(op, shape, dtype)
        heuristic = {name: schedules.heuristic_knobs(f, target) for name, f in funcs.items()}
        print(f"{case['id']}: heuristic {heuristic}", flush=True)
        variants = [None] + [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        for variant in variants:
            problems = [problem for name, func in funcs.items()
                        if (problem := knobs_problem(func, target, {**heuristic[name], **(variant or {})}))]
            if problems:  # the build would take the heuristic instead: its time must not carry this label
                print(f"  {variant}: skipped: knobs {problems[0]}", flush=True)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                log = os.path.join(tmp, "log.jsonl")
                for name, func in funcs.items():
                    append_record(log, func, target, name, {**heuristic[name], **(variant or {})}, us=1.0)
                try:
                    fn = tvm_callable(tvm_ext.build(mod, target, database=log, variance=args.variance))
                    err = max_err(fn(*inputs), ref)
                    us = flushed_device_us(fn, inputs)
                except Exception as e:  # a variant a template refuses or TVM cannot lower
                    print(f"  {variant}: failed: {str(e).strip().splitlines()[-1][:150]}", flush=True)
                    continue
            print(f"  {str(variant or 'heuristic'):40s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s err {err:.3g}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
