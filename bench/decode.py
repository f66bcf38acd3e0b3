"""One decoding step with a KV cache on this GPU: ours (built once for any batch and cache length)
vs torch.compile (dynamic, and with CUDA graphs per shape) vs eager, in one process.

    python -m bench.decode --models llama-decode,llama-decode-gqa --batches 1,8,32 \
        --lengths 128,512,1024,2048,4096 --out bench/results/NAME

The decode layers of `examples/torch_models.py` take one new token per sequence and the past keys
and values, and return the output and the cache grown by one. Per (batch, cache length): wall time
(medians of `triton.testing.do_bench`, L2 flushed) and device time (torch.profiler, kernels back to
back; ours built without programmatic dependent launch), tokens per second, and the bytes a step
must move (weights, the cache read, the grown cache written) over our device time against the copy
bandwidth, and our kernels' device times. torch.compile with CUDA graphs (`mode="reduce-overhead"`) is compiled per shape and its
outputs are used as the graph leaves them (valid until its next call). Outputs are checked against
eager. Writes NAME.json and NAME.md after each shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time

import tvm  # import TVM before torch (see the field guide)
import tvm_ext

import torch  # noqa: E402  pylint: disable=wrong-import-order

from bench.e2e import REPEATS, device_events, build_serial_launch, device_us, graphed
from bench.run import copy_gbps, max_err, time_us, tvm_callable
from examples.torch_models import DECODE_DYNAMIC, decode_inputs, make_decode

IMPLS = ("ours", "torch_dynamic", "torch_graphs", "eager")
KERNELS = 16  # of ours per shape in the breakdown, most time first (a decode step launches about 16)
DEVICE_TIMED = {"ours": "ours_serial", "torch_dynamic": "torch_dynamic", "torch_graphs": "torch_graphs"}


def step_bytes(module, batch: int, past: int) -> int:
    """Bytes one step must move: the weights once, the cache read, the grown cache written."""
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    row = module.kv_heads * module.head_dim * 2 * batch  # one position of keys or values, fp16
    return weights + 2 * row * past + 2 * row * (past + 1)


def run_model(name: str, batches: list[int], lengths: list[int], result: dict, log, save) -> None:
    """Fill `result` with `name`'s runs, calling `save` after each."""
    module, inputs = make_decode(name)
    mod = tvm_ext.from_torch(module, *inputs, dynamic=DECODE_DYNAMIC)
    module = module.cuda()
    target = tvm_ext.parse_target("cuda")
    started = time.perf_counter()
    impls = {"ours": tvm_callable(tvm_ext.build(mod, target))}
    result["build_s"] = round(time.perf_counter() - started, 1)
    impls["ours_serial"] = tvm_callable(build_serial_launch(mod, target))
    torch._dynamo.reset()  # pylint: disable=protected-access
    torch._dynamo.config.recompile_limit = 256  # pylint: disable=protected-access
    impls.update(torch_dynamic=torch.compile(module, dynamic=True), torch_graphs=graphed(module, copy_out=False), eager=module)
    with torch.no_grad():
        for batch in batches:
            for past in lengths:
                args = decode_inputs(module, batch, past, torch.float16, device="cuda")
                run = {"batch": batch, "past": past, "bytes": step_bytes(module, batch, past),
                       "max_abs_err": max_err(impls["ours"](*args), module(*args))}
                for impl in IMPLS:
                    try:
                        impls[impl](*args)
                        run[f"{impl}_us"] = time_us(impls[impl], args)
                    except Exception as err:  # one failing implementation must not sink the table
                        run[f"{impl}_us"] = None
                        run[f"{impl}_error"] = str(err).splitlines()[0][:300]
                for impl, timed in DEVICE_TIMED.items():
                    run[f"{impl}_device_us"] = device_us(impls[timed], args) if run.get(f"{impl}_us") else None
                events = sorted(device_events(impls["ours_serial"], args), key=lambda e: -e[1] * e[0].count)
                run["kernels"] = [{"kernel": e.key, "us": us, "calls": e.count / REPEATS} for e, us in events[:KERNELS]]
                result["runs"].append(run)
                log(f"{name} {run}")
                save()


def markdown(results: list[dict], copy: float) -> str:
    lines = []
    for r in results:
        lines += [f"{r['model']} (built once in {r['build_s']} s; ratios: their time / ours):", "",
                  "| batch | past | ours us (wall / device) | tokens/s, ours | torch.compile dynamic (wall / device) | "
                  "vs it, wall / device | torch.compile CUDA graphs (wall / device) | vs it, wall / device | eager us | "
                  "GB/s moved, ours device | of copy | max abs err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in r["runs"]:
            def pair(impl):
                wall, dev = x.get(f"{impl}_us"), x.get(f"{impl}_device_us")
                return "-" if not wall else f"{wall:.1f} / {dev:.1f}"

            def ratio(impl):
                wall, dev = x.get(f"{impl}_us"), x.get(f"{impl}_device_us")
                if not (wall and x.get("ours_us")):
                    return "-"
                return f"{wall / x['ours_us']:.2f}x / {dev / x['ours_device_us']:.2f}x"
            gbps = x["bytes"] / x["ours_device_us"] / 1e3 if x.get("ours_device_us") else None
            tokens = f"{x['batch'] / x['ours_us'] * 1e6:.0f}" if x.get("ours_us") else "-"
            lines.append(f"| {x['batch']} | {x['past']} | {pair('ours')} | {tokens} | {pair('torch_dynamic')} | "
                         f"{ratio('torch_dynamic')} | {pair('torch_graphs')} | {ratio('torch_graphs')} | "
                         f"{x['eager_us']:.1f} | " + (f"{gbps:.0f} | {gbps / copy:.0%}" if gbps else "- | -")
                         + f" | {x['max_abs_err']:.3g} |")
        lines += ["", "Our kernels per step, most time first (device us x calls, serial launch):", ""]
        lines += [f"- batch {x['batch']}, past {x['past']}: " + ", ".join(
            f"{k['kernel'].removesuffix('_kernel')} {k['us']:.1f} x{k['calls']:.0f}" for k in x.get("kernels", []))
            for x in r["runs"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-decode,llama-decode-gqa")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    args = ap.parse_args(argv)
    batches, lengths = ([int(n) for n in s.split(",")] for s in (args.batches, args.lengths))
    copy = copy_gbps()
    results: list[dict] = []

    def save():
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "tvm": tvm.__version__, "copy_gbps": copy, "results": results}, f, indent=1)
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(markdown(results, copy) + "\n")

    for name in filter(None, args.models.split(",")):
        results.append({"model": name, "runs": [], "build_s": None})
        run_model(name, batches, lengths, results[-1], print, save)
    print(f"copy {copy:.0f} GB/s\n" + markdown(results, copy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
