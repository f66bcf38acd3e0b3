"""The model zoo (examples/zoo.py) on this GPU: ours vs TVM's default vs torch eager vs torch.compile.

    python -m bench.zoo --out bench/results/NAME [--models gpt2,llama_mask,...] [--dtype float16] [--attn sdpa] [--seq 128] [--breakdown]

Each model, called as users call it, is imported with `tvm_ext.from_torch` and timed by
`bench.e2e.run_module` in this one process; a model or implementation that fails gets a row that
says why. torch.compile starts afresh for each model (its recompile limit would otherwise turn it
into eager). Writes NAME.json and NAME.md after each model.
"""

from __future__ import annotations

import argparse
import inspect

import tvm  # noqa: F401  (import TVM before torch: see the field guide)

import torch  # noqa: E402  pylint: disable=wrong-import-order

from bench.e2e import markdown, run_module, save
from examples.zoo import HAS_ATTN, ZOO


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO), help=f"comma-separated, of: {', '.join(ZOO)}")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="transformers' attention implementation")
    ap.add_argument("--seq", type=int, default=None, help="sequence length for the text models (default: the zoo's)")
    ap.add_argument("--breakdown", action="store_true", help="also profile each of our kernels (slower)")
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(ZOO))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(ZOO)}")
    results = []
    for name in args.models.split(","):
        torch._dynamo.reset()
        options = {"attn": args.attn} if name in HAS_ATTN else {}
        if args.seq and "seq" in inspect.signature(ZOO[name]).parameters:
            options["seq"] = args.seq
        module, inputs = ZOO[name](dtype=args.dtype, **options)
        shapes = "x".join(map(str, inputs[0].shape))
        results.append(run_module(f"{name} {args.dtype} {args.attn if name in HAS_ATTN else ''} {shapes}".strip(), module,
                                  inputs, None, print, breakdown=args.breakdown))
        save(args.out, results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
