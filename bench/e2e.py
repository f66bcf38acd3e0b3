"""Whole PyTorch models on this GPU: ours vs TVM's default pipeline vs torch eager vs torch.compile.

    python -m bench.e2e --models llama-seq512,bert-seq128,resnet-train-bn --out bench/results/NAME \
        [--database LOG] [--dynamic-seq 1,77,512,2048]

Each model of `examples/torch_models.py` is imported with `tvm_ext.from_torch`, built with the
tvm_ext pipeline (tuned when --database is given) and with TVM's default pipeline (dlight rules;
given only our fix for relax.full, which it cannot legalize),
and timed with torch eager and torch.compile in this one process on the same input (medians of
`triton.testing.do_bench`, L2 flushed). Device time (torch.profiler, kernels back to back) is given
beside wall time for ours and torch.compile: on small models torch.compile's wall time is its
host's enqueueing. `ours_serial_launch` is our build without programmatic
dependent launch (tvm_ext/tir/dependent_launch.py): each kernel waits for the one before it to
retire. Outputs are checked against eager. Per kernel of ours (torch.profiler, on the serial-launch
build: with dependent launch a kernel's span includes its wait for the one before): time and, for
the fused reduce kernels, GB/s. --dynamic-seq builds the LLaMA layer once
with a symbolic sequence length and runs it at each length, beside our static build of that length
and torch.compile, dynamic and static. Writes NAME.json and NAME.md; results
are written after each model, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import tvm  # import TVM before torch (see the field guide)
import tvm_ext
from tvm import relax
from tvm_ext.relax.legalize import legalize_full
from tvm_ext.tir import tir_pass_disabled
from tvm_ext.tir.dependent_launch import dependent_launch
from tvm_ext.target import without_arch_specific

import torch  # noqa: E402  pylint: disable=wrong-import-order

from bench.run import max_err, time_us, tvm_callable
from examples.torch_models import make
from tvm_ext.schedules.analysis import is_reduce_subgraph
from tvm_ext.search.check import task_bytes
from tvm_ext.search.tasks import extract_tasks

REPEATS = 5  # profiled calls per model
DEVICE_TIMED = ("ours_serial_launch", "torch_compile", "torch_compile_graphs")  # device time as well as wall time
# (serial: kernels' own spans)


def kernel_breakdown(fn, mod, target, args) -> list[dict]:
    """Our kernels' average device times as CUPTI sees them (torch.profiler traces every kernel of the
    process; TVM's VM has no profiler in 0.27), with GB/s for the fused reduce ones (bytes of their
    parameters). A kernel of function F is named F_kernel (F_kernel_1, ... for several)."""
    reduce_bytes = {t.name: task_bytes(t.func) for t in extract_tasks(mod, target) if is_reduce_subgraph(t.func)}
    rows = []
    for event, us in device_events(fn, args):
        row = {"kernel": event.key, "us": us, "calls": event.count / REPEATS}
        func = event.key.split("_kernel")[0]
        if func in reduce_bytes:
            row["gbps"] = reduce_bytes[func] / us / 1e3
        rows.append(row)
    return sorted(rows, key=lambda r: -r["us"] * r["calls"])


def device_events(fn, args) -> list:
    """(event, mean device us per occurrence) for each kernel or copy that REPEATS calls of fn run."""
    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            fn(*args)
        torch.cuda.synchronize()
    events = ((e, getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)) for e in prof.key_averages())
    return [(e, us) for e, us in events if us]


def device_us(fn, args) -> float:
    """Device time of one call of fn, kernels back to back: what it costs once the host keeps up (the
    wall time of torch.compile's default mode on small models is the host's enqueueing)."""
    return sum(us * e.count for e, us in device_events(fn, args)) / REPEATS


def build_serial_launch(mod, target, **options):
    """`tvm_ext.build` without programmatic dependent launch: each kernel starts once the one before
    it has retired, so the profiler's kernel times are the kernels' own."""
    with tir_pass_disabled(dependent_launch):
        return tvm_ext.build(mod, target, **options)


def with_full_legalized(mod):
    """`mod` legalized as TVM's default pipeline would, except relax.full, with our fix: TVM 0.27's own
    legalization of it fails, so its default pipeline cannot build a model with a causal mask."""
    return relax.transform.LegalizeOps({"relax.full": legalize_full, "relax.full_like": legalize_full})(mod)


def graphed(module, copy_out: bool = True):
    """torch.compile with CUDA graphs (mode="reduce-overhead"), each call a new step; `copy_out`:
    its outputs copied out (one small copy kernel: the graph's own output buffers are overwritten by
    the next replay), else used where the graph leaves them (a decode step's grown KV cache, too
    large to copy for free)."""
    compiled = torch.compile(module, mode="reduce-overhead", dynamic=False)

    def call(*args):
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args)
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out) if copy_out else out
    return call


def run_model(name: str, database: str | None, log) -> dict:
    module, x = make(name)
    return run_module(name, module, (x,), database, log)


def run_module(name: str, module, inputs: tuple, database: str | None, log, breakdown: bool = True) -> dict:
    """`module(*inputs)` (CPU tensors) timed as ours, ours without dependent launch, TVM's default,
    torch eager and torch.compile; each implementation's error or time and max abs error vs eager."""
    try:
        mod = tvm_ext.from_torch(copy.deepcopy(module), *inputs)  # from CPU tensors: the frontend copies weights out
    except Exception as err:  # the model does not import: a row that says why
        return {"model": name, "impls": {"ours": {"error": f"import: {str(err).splitlines()[0][:300]}"}}}
    module, inputs = module.cuda(), tuple(x.cuda() for x in inputs)
    x = inputs[0]
    with torch.no_grad():
        ref = module(*inputs)
        target = tvm_ext.parse_target("cuda")
        # TVM's default on the plain arch: on sm_90a its dlight rules leave the tensor cores out
        plain = without_arch_specific(target)
        impls, built, result = {"torch_eager": module}, {}, {"model": name, "shape": list(x.shape),
                                                             "dtype": str(x.dtype), "impls": {},
                                                             "weight_bytes": sum(p.numel() * p.element_size()
                                                                                 for p in module.parameters())}
        ours = {"ours": lambda: tvm_ext.build(mod, target, database=database)}
        ours["ours_serial_launch"] = lambda: build_serial_launch(mod, target, database=database)
        if str(plain.attrs["arch"]) != str(target.attrs["arch"]):  # the same pipeline without the arch-specific (wgmma) matmuls
            ours["ours_mma_sync"] = lambda: tvm_ext.build(mod, plain, database=database)
        for impl, build in {**ours,
                            "tvm_default": lambda: tvm.compile(with_full_legalized(mod), target=plain),
                            "torch_compile": lambda: torch.compile(module, dynamic=False),
                            "torch_compile_graphs": lambda: graphed(module)}.items():
            started = time.perf_counter()
            try:
                built[impl] = build()
                impls[impl] = built[impl] if impl.startswith("torch_compile") else tvm_callable(built[impl])
            except Exception as err:  # one failing implementation must not sink the table
                result["impls"][impl] = {"error": str(err).splitlines()[0][:300]}
            result.setdefault("build_s", {})[impl] = round(time.perf_counter() - started, 1)
        for impl, fn in impls.items():
            try:
                out = fn(*inputs)
                out = out[0] if isinstance(out, tuple) and len(out) == 1 else out
                torch.cuda.synchronize()
                result["impls"][impl] = {"us": time_us(fn, inputs), "max_abs_err": max_err(out, ref)}
                if impl in DEVICE_TIMED:
                    result["impls"][impl]["device_us"] = device_us(fn, inputs)
            except Exception as err:
                result["impls"][impl] = {"error": str(err).splitlines()[0][:300]}
            log(f"{name} {impl}: {result['impls'][impl]}")
        for impl in ("ours", "tvm_default"):
            if impl in built:
                result["impls"][impl]["kernels"] = len(tvm_ext.cuda_kernels(built[impl]))
        if "ours" in built and breakdown:
            result["breakdown"] = kernel_breakdown(impls.get("ours_serial_launch", impls["ours"]), mod, target, inputs)
    return result


def run_dynamic(lengths: list[int], database: str | None, log) -> dict:
    """The LLaMA layer compiled once with a symbolic sequence length, run at each length beside our
    static build of that length, torch.compile(dynamic=True) (compiled once), torch.compile of that
    length and eager, in this process; device time (serial-launch builds) for ours and torch.compile."""
    module, x = make("llama-seq512")
    mod = tvm_ext.from_torch(copy.deepcopy(module), x, dynamic={0: {1: "seq"}})
    module, target = module.cuda(), tvm_ext.parse_target("cuda")
    out = {"model": "llama-dynamic-seq", "runs": []}
    torch._dynamo.config.recompile_limit = 64  # pylint: disable=protected-access
    with torch.no_grad():
        started = time.perf_counter()
        symbolic = tvm_callable(tvm_ext.build(mod, target, database=database))
        symbolic_serial = tvm_callable(build_serial_launch(mod, target, database=database))
        out["build_s"] = round(time.perf_counter() - started, 1)
        dynamic = torch.compile(module, dynamic=True)
        for n in lengths:
            xi = torch.randn(1, n, x.shape[-1], device="cuda").to(x.dtype)
            ref = module(xi)
            run = {"seq": n, "max_abs_err": max_err(symbolic(xi)[0], ref)}
            static_mod = tvm_ext.from_torch(copy.deepcopy(module).cpu(), xi.cpu())
            impls = {"symbolic": symbolic, "static": tvm_callable(tvm_ext.build(static_mod, target, database=database)),
                     "torch_dynamic": dynamic, "torch_static": torch.compile(module, dynamic=False), "eager": module}
            for impl, fn in impls.items():
                try:
                    fn(xi)
                    run[f"{impl}_us"] = time_us(fn, [xi])
                except Exception as err:  # one failing implementation must not sink the table
                    run[f"{impl}_us"] = None
                    run[f"{impl}_error"] = str(err).splitlines()[0][:300]
            run["symbolic_device_us"] = device_us(symbolic_serial, [xi])
            run["torch_dynamic_device_us"] = device_us(dynamic, [xi])
            out["runs"].append(run)
            log(f"dynamic seq {run}")
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| model | ours us | ours, serial launch us | ours, mma.sync matmuls us | TVM default us | torch eager us | "
             "torch.compile us | torch.compile, CUDA graphs us | device us: ours / torch.compile / graphs | "
             "vs torch.compile | vs torch.compile, device | vs CUDA graphs | vs CUDA graphs, device | weights GB/s, "
             "ours device | vs TVM default | kernels ours/TVM | ours err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in results if "impls" in r):
        impls = r["impls"]
        us = {k: v.get("us") for k, v in impls.items()}
        device = {k: impls.get(k, {}).get("device_us") for k in DEVICE_TIMED}
        cell = lambda k: f"{us[k]:.1f}" if us.get(k) else impls.get(k, {}).get("error", "-")[:40]  # noqa: E731
        ratio = lambda theirs, ours: f"{theirs / ours:.2f}x" if theirs and ours else "-"  # noqa: E731
        kernels = f"{impls.get('ours', {}).get('kernels', '-')}/{impls.get('tvm_default', {}).get('kernels', '-')}"
        err = impls.get("ours", {}).get("max_abs_err")
        times = " | ".join(cell(k) for k in ("ours", "ours_serial_launch", "ours_mma_sync", "tvm_default", "torch_eager",
                                             "torch_compile", "torch_compile_graphs"))
        device_cells = "/".join("-" if v is None else f"{v:.1f}" for v in device.values())
        ours_device = device["ours_serial_launch"]
        weights = f"{r['weight_bytes'] / ours_device / 1e3:.0f}" if r.get("weight_bytes") and ours_device else "-"
        lines.append(f"| {r['model']} | {times} | {device_cells} | {ratio(us.get('torch_compile'), us.get('ours'))} | "
                     f"{ratio(device['torch_compile'], ours_device)} | "
                     f"{ratio(us.get('torch_compile_graphs'), us.get('ours'))} | "
                     f"{ratio(device['torch_compile_graphs'], ours_device)} | {weights} | "
                     f"{ratio(us.get('tvm_default'), us.get('ours'))} | {kernels} | {'-' if err is None else f'{err:.3g}'} |")
    for r in (r for r in results if "breakdown" in r):
        lines += ["", f"Our kernels in {r['model']} (torch.profiler on the serial-launch build, most time first; GB/s for "
                  "fused reduce kernels):", "",
                  "| kernel | us | GB/s |", "|---|---|---|"]
        lines += [f"| {k['kernel']} | {k['us']:.1f} | {k['gbps']:.0f} |" if "gbps" in k else
                  f"| {k['kernel']} | {k['us']:.1f} | - |" for k in r["breakdown"][:12]]
    for r in (r for r in results if "runs" in r):
        lines += ["", "LLaMA layer compiled once with a symbolic sequence length (us; device us from the profiler):", "",
                  "| seq | ours symbolic | ours static | symbolic vs static | torch.compile dynamic | vs torch dynamic | "
                  "torch.compile static | eager | device: ours symbolic / torch dynamic | max abs err |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for x in r["runs"]:
            us = {k: x.get(f"{k}_us") for k in ("symbolic", "static", "torch_dynamic", "torch_static", "eager")}
            cell = lambda k: "-" if us[k] is None else f"{us[k]:.1f}"  # noqa: E731
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
            lines.append(f"| {x['seq']} | {cell('symbolic')} | {cell('static')} | {ratio(us['static'], us['symbolic'])} | "
                         f"{cell('torch_dynamic')} | {ratio(us['torch_dynamic'], us['symbolic'])} | {cell('torch_static')} | "
                         f"{cell('eager')} | {x['symbolic_device_us']:.1f} / {x['torch_dynamic_device_us']:.1f} | "
                         f"{x['max_abs_err']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-seq512,bert-seq128,resnet-train-bn")
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    ap.add_argument("--database", default=None, help="tuning log for our build")
    ap.add_argument("--dynamic-seq", default="", help="sequence lengths for the symbolic-length LLaMA layer")
    args = ap.parse_args(argv)
    results = []
    for name in filter(None, args.models.split(",")):  # --models "" with --dynamic-seq: the symbolic layer alone
        torch._dynamo.reset()  # each model's torch.compile starts fresh: past the recompile limit it would run eager
        results.append(run_model(name, args.database, print))
        save(args.out, results)
    if args.dynamic_seq:
        results.append(run_dynamic([int(n) for n in args.dynamic_seq.split(",")], args.database, print))
        save(args.out, results)
    print(markdown(results))
    return 0


def save(out: str, results: list[dict]) -> None:
    """OUT.json (with the GPU and versions) and OUT.md, rewritten after each model."""
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                   "tvm": tvm.__version__, "results": results}, f, indent=1)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(results) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
