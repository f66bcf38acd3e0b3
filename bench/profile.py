"""Run our kernel of each listed suite case a few times, for a profiler to watch (ncu on the GPU machine).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats -k regex:_kernel --csv --page details \
        python -m bench.profile --cases ln-16384x384-f16,col-sum [--suite bench/suite.json]

Static shapes only (a dynamic case runs at its first listed value). Only TVM runs here: the
kernels ncu sees are ours alone.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import concrete_shape, load_suite, random_inputs, relax_module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="bench/suite.json")
    ap.add_argument("--cases", required=True, help="comma-separated case ids")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cases = {c["id"]: c for c in load_suite(args.suite)}
    unknown = [name for name in args.cases.split(",") if name not in cases]
    if unknown:
        raise SystemExit(f"unknown case ids {unknown}; the suite has {sorted(cases)}")
    rng = np.random.default_rng(0)
    for name in args.cases.split(","):
        case = cases[name]
        values = {dim: vals[0] for dim, vals in (case.get("dynamic") or {}).items()}
        shape = concrete_shape(case["shape"], values)
        vm = VirtualMachine(tvm_ext.build(relax_module(case["op"], case["shape"], case["dtype"]), "cuda"), tvm.cuda(0))
        dtype = ml_dtypes.bfloat16 if case["dtype"] == "bfloat16" else case["dtype"]
        inputs = [tvm.runtime.tensor(a.astype(dtype), tvm.cuda(0)) for a in random_inputs(case["op"], shape, rng)]
        for _ in range(args.repeat):
            vm["main"](*inputs)
        tvm.cuda(0).sync()
        print(f"profiled {name} {shape}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
