"""A gated MLP's activation in its matmul's epilogue, or not: LLaMA layers built both ways and
torch.compile, timed in one process.

    python -m bench.gated_ab --models llama-seq512,llama-seq2048 --rounds 7 --out bench/results/NAME

`ours_gated` is the pipeline as it is (tvm_ext/relax/gated_linears.py); `ours_apart` is built with the
joined gate and up weights concatenated, so that a second kernel reads the two halves of the
matmul's output. The implementations take turns in each of `--rounds` rounds (medians reported, as
bench/timeline.py does); each of ours also gets one call's kernels off the GPU timeline.
Writes NAME.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import tvm  # noqa: F401  import TVM before torch (see the field guide)
import tvm_ext

import torch  # noqa: E402  pylint: disable=wrong-import-order

from bench.run import max_err, time_us, tvm_callable
from bench.timeline import one_call
from examples.torch_models import make
from tvm_ext.relax import gated_linears


def builds(mod) -> dict:
    """{variant: callable} of `mod` built with the gated epilogue and with the halves apart."""
    interleavable, built = gated_linears.interleavable, {}
    try:
        for variant, rule in (("ours_gated", interleavable), ("ours_apart", lambda weights: False)):
            gated_linears.interleavable = rule
            built[variant] = tvm_callable(tvm_ext.build(mod, "cuda"))
    finally:
        gated_linears.interleavable = interleavable
    return built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-seq512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", required=True, help="path without extension; NAME.json is written")
    args = parser.parse_args(argv)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than the L2
    result = {"device": torch.cuda.get_device_name(), "rounds": args.rounds, "models": {}}
    for name in args.models.split(","):
        module, x = make(name)
        mod = tvm_ext.from_torch(copy.deepcopy(module), x)
        module, x = module.cuda(), x.cuda()
        with torch.no_grad():
            ref = module(x)
            impls = {**builds(mod), "torch_compile": torch.compile(module, dynamic=False)}
            res = {impl: {"us": [], "err": max_err(fn(x), ref)} for impl, fn in impls.items()}
            for _ in range(args.rounds):
                for impl, fn in impls.items():
                    res[impl]["us"].append(round(time_us(fn, [x]), 1))
            for impl, fn in impls.items():
                res[impl]["median_us"] = statistics.median(res[impl]["us"])
                if impl != "torch_compile":
                    res[impl]["kernels"] = one_call(fn, x, flush)["kernels"]
                print(name, impl, res[impl]["median_us"], res[impl]["us"], "err", res[impl]["err"], flush=True)
        result["models"][name] = res
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
