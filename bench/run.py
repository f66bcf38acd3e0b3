"""Time the suite on this GPU: ours, PyTorch eager, torch.compile, TVM dlight defaults, and a copy.

    python -m bench.run --suite bench/suite.json --out bench/results/ [--cases ln-,rms-] [--database LOG]
        [--impls ours,torch_compile]  (a quick look: only those implementations)

Every implementation runs in this one process on the same inputs, L2 flushed before each timed call.
Each row has two medians: device time (`us`: the GPU held by a sleep kernel while the host enqueues,
so a host-bound caller is timed by its kernels) and wall time (`wall_us`: `triton.testing.do_bench`,
where a slow host shows). Writes <gpu>-<date>[-tag].json, a Markdown table (.md) and a bandwidth
plot (.png) made from that JSON (see bench/report.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import tvm  # import TVM before torch (see the field guide)
from tvm_ext import schedules
import tvm_ext
from tvm.runtime.vm import VirtualMachine
from tvm_ext.pipeline import fused_reduce_functions

import torch  # noqa: E402  pylint: disable=wrong-import-order
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench import spelled
from bench.report import write_reports
from bench.suite import EPS, concrete_shape, effective_bytes, input_shapes, load_suite, relax_module

TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_fn(op: str):
    """The suite's PyTorch definition of `op` (see suite.json)."""
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS[op])
    if op == "rms_norm":
        return lambda x, w: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS[op])).to(x.dtype) * w
    if op == "softmax":
        return lambda x: torch.softmax(x, -1)
    if op == "bn_stats":
        return lambda x: tuple(reversed(torch.var_mean(x, dim=(0, 2, 3), unbiased=False)))  # (mean, var) as ours
    if op == "row_sum":
        return lambda x: x.sum(1)
    if op == "col_sum":
        return lambda x: x.sum(0)
    if op == "full_sum":
        return lambda x: x.sum()
    raise ValueError(op)


SPELLED = {"rms_norm": "rms_norm_llama", "layer_norm": "layer_norm_spelled", "softmax": "softmax_spelled"}


def torch_spelled_fn(op: str):
    """The same op as PyTorch code spells it out (bench/spelled.py has the Relax twin)."""
    eps = spelled.EPS
    if op == "layer_norm":
        def layer_norm(x, w, b):
            xf = x.float()
            centred = xf - xf.mean(-1, keepdim=True)
            y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps)
            return y.to(x.dtype) * w + b
        return layer_norm
    if op == "softmax":
        def softmax(x):
            e = torch.exp(x - x.max(-1, keepdim=True)[0])
            return e / e.sum(-1, keepdim=True)
        return softmax
    return lambda x, w: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def tvm_callable(executable):
    """Call `main` on torch tensors through DLPack; returns torch tensors."""
    vm = VirtualMachine(executable, tvm.cuda(0))
    main = vm["main"]

    def call(*args):
        out = main(*[tvm.runtime.from_dlpack(a) for a in args])
        return tuple(torch.from_dlpack(o) for o in (out if not hasattr(out, "numpy") else [out]))

    return call


def max_err(outs, refs) -> float:
    return max(float((o.double() - r.double()).abs().max()) for o, r in zip(as_tuple(outs), as_tuple(refs)))


def time_us(fn, args) -> float:
    """Wall time: do_bench's median, L2 flushed; includes the host where it cannot keep ahead."""
    return do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median") * 1e3


FLUSH_BYTES = 256 << 20  # as do_bench's L2 flush


def _sleep_cycles_per_us() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)  # pylint: disable=protected-access
    end.record()
    torch.cuda.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1e3)


def flushed_device_us(fn, args, reps: int = 100) -> float:
    """Device time: the median, L2 flushed, of one call with the GPU kept busy by a sleep kernel for
    twice the host's enqueueing time before each flush, so the host is always ahead and the time
    between the events is the call's kernels and their launch gaps on the GPU, not the host's
    Python (torch.compile's wrappers, the VM's DLPack conversions)."""
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        fn(*args)
    host_us = (time.perf_counter() - t0) / 10 * 1e6
    torch.cuda.synchronize()
    cycles = int(_sleep_cycles_per_us() * (2 * host_us + 20))
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        torch.cuda._sleep(cycles)  # pylint: disable=protected-access
        cache.zero_()
        start.record()
        fn(*args)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def copy_gbps() -> float:
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = flushed_device_us(dst.copy_, [src])
    return 2 * src.numel() * 4 / us / 1e3


STATISTICS_OPS = ("layer_norm", "bn_stats")  # the ops whose variance algorithm is a build option


def run_case(case: dict, database, log, variance_algorithms=(), int64=False, spelled_out=False,
             wanted=None) -> list[dict]:
    """Rows of one case; `wanted`: implementation names to keep (None: all)."""
    op, dtype, shape = case["op"], case["dtype"], case["shape"]
    mod = relax_module(op, shape, dtype)
    t0 = time.time()
    builders = {"ours": lambda: tvm_ext.build(mod, "cuda"),
                "tvm_dlight": lambda: tvm.compile(mod, target=tvm_ext.parse_target("cuda"))}
    if database:
        builders["ours_tuned"] = lambda: tvm_ext.build(mod, "cuda", database=database)
    if int64:  # our kernels without tvm_ext's index narrowing (TVM's own static narrowing stays)
        builders["ours_int64"] = lambda: tvm_ext.build(mod, "cuda", narrow_index=False)
    if spelled_out and op in SPELLED:  # the op as models spell it: one kernel after reduce fusion?
        spelled_mod = spelled.module(SPELLED[op], shape, dtype)
        builders["ours_spelled"] = lambda: tvm_ext.build(spelled_mod, "cuda")
        builders["tvm_dlight_spelled"] = lambda: tvm.compile(spelled_mod, target=tvm_ext.parse_target("cuda"))
    for algorithm in variance_algorithms if op in STATISTICS_OPS else ():
        builders[f"ours_{algorithm}"] = lambda a=algorithm: tvm_ext.build(mod, "cuda", variance=a)
    keep = lambda name: wanted is None or name in wanted  # noqa: E731
    builders = {name: builder for name, builder in builders.items() if keep(name)}
    built, failed = {}, {}
    for name, builder in builders.items():
        try:
            built[name] = builder()
        except Exception as err:  # e.g. TVM's own layer_norm refuses bfloat16: a row, not a crash
            failed[name] = f"build failed: {str(err).strip().splitlines()[-1][:300]}"
            log(f"  {name:14s} {failed[name]}")
    impls = {name: tvm_callable(ex) for name, ex in built.items()}
    target = tvm_ext.parse_target("cuda")
    strategy = "+".join(k["strategy"] for f in fused_reduce_functions(mod, target).values()
                        for _, k in schedules.plan(f, target))  # what the heuristic picked
    impls["torch_eager"] = torch_fn(op)
    # a fresh dynamo cache per case: the suite's lambdas share code objects across cases, and past
    # dynamo's recompile limit (8) torch.compile silently runs eager (seen in this harness until
    # 2026-11-21's last run: ln-dyn from n=77 on timed eager under the torch_compile label)
    torch._dynamo.reset()  # pylint: disable=protected-access
    impls["torch_compile"] = torch.compile(torch_fn(op), dynamic=False)
    if spelled_out and op in SPELLED:
        impls["torch_eager_spelled"] = torch_spelled_fn(op)
        impls["torch_compile_spelled"] = torch.compile(torch_spelled_fn(op), dynamic=False)
    log(f"  built in {time.time() - t0:.1f}s")

    dyn = case.get("dynamic") or {}
    points = [{}]
    for name, values in dyn.items():
        points = [dict(p, **{name: v}) for p in points for v in values]
    rows = [{"case": case["id"], "op": op, "impl": name, "n": None, "error": why} for name, why in failed.items()]
    for values in points:
        conc = concrete_shape(shape, values)
        gen = torch.Generator(device="cuda").manual_seed(0)
        args = [(torch.randn(s, device="cuda", generator=gen) * 2 + 0.5).to(TORCH_DTYPE[dtype])
                for s in input_shapes(op, conc)]
        ref = impls["torch_eager"](*args)
        ref64 = torch_fn(op)(*[a.double() for a in args])
        nbytes = effective_bytes(op, conc, dtype)
        point_impls = {name: fn for name, fn in impls.items() if keep(name)}
        if int64 and values:  # the same shape built static: what the symbolic build's host dispatch costs
            point_impls["ours_static"] = tvm_callable(tvm_ext.build(relax_module(op, conc, dtype), "cuda"))
        if keep("copy"):  # the practical limit at this size: a copy moving as many bytes
            half = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device="cuda")
            point_impls["copy"] = lambda *_, src=half, dst=torch.empty_like(half): dst.copy_(src)
        for impl, fn in point_impls.items():
            try:
                out = fn(*args)
                torch.cuda.synchronize()
                us, wall_us = flushed_device_us(fn, args), time_us(fn, args)
            except Exception as err:  # one broken implementation must not sink the table
                rows.append({"case": case["id"], "impl": impl, "n": values or None, "error": str(err)[:300]})
                log(f"  {impl:14s} FAILED: {str(err).splitlines()[0][:120]}")
                continue
            row = {"case": case["id"], "op": op, "impl": impl, "us": us, "wall_us": wall_us,
                   "gbps": nbytes / us / 1e3, "n": values or None}
            if impl != "copy":
                row.update(max_abs_err=max_err(out, ref), max_abs_err_fp64=max_err(out, ref64))
            if impl in built:
                row["kernels"] = len(tvm_ext.cuda_kernels(built[impl]))
            if impl == "ours":
                row["strategy"] = strategy
            rows.append(row)
            log(f"  {impl:14s} {values or ''} {us:9.1f} us (wall {wall_us:7.1f}) {row['gbps']:7.0f} GB/s err {row.get('max_abs_err', 0):.3g}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="bench/suite.json")
    ap.add_argument("--out", default="bench/results/")
    ap.add_argument("--cases", default="", help="comma-separated id prefixes to run (default: all)")
    ap.add_argument("--database", default=None, help="tuning log: adds an ours_tuned row per case")
    ap.add_argument("--tag", default="")
    ap.add_argument("--variance", default="", help="comma-separated variance algorithms to add as ours_<name> rows "
                                                   "on LayerNorm and batch-statistics cases (welford,two_pass,one_pass)")
    ap.add_argument("--spelled", action="store_true", help="add the norms and softmax as models spell them out "
                    "(bench/spelled.py): ours, dlight, torch eager and torch.compile on that code")
    ap.add_argument("--int64", action="store_true", help="add ours_int64 rows: built without index narrowing "
                    "(and, for symbolic cases, ours_static rows: each point built with static shapes)")
    ap.add_argument("--impls", default="", help="comma-separated implementations to time (default: all; "
                    "a quick look, not a comparison to publish)")
    args = ap.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # dynamic cases compile once per listed size
    if not torch.cuda.is_available() or not tvm.cuda(0).exist:
        print("bench.run needs a CUDA GPU visible to both PyTorch and TVM", file=sys.stderr)
        return 2
    prefixes = [p for p in args.cases.split(",") if p]
    cases = [c for c in load_suite(args.suite) if not prefixes or any(c["id"].startswith(p) for p in prefixes)]
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    gpu = torch.cuda.get_device_name(0)
    result = {"device": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "tvm": tvm.__version__, "copy_gbps": copy_gbps(), "rows": []}
    log(f"{gpu}: device copy {result['copy_gbps']:.0f} GB/s")
    os.makedirs(args.out, exist_ok=True)
    slug = gpu.lower().replace("nvidia ", "").split()[0]
    stem = os.path.join(args.out, f"{slug}-{result['date']}{'-' + args.tag if args.tag else ''}")
    for case in tqdm(cases, desc="suite", file=sys.stdout):
        log(case["id"])
        result["rows"] += run_case(case, args.database, log, [a for a in args.variance.split(",") if a], args.int64,
                                   args.spelled, [i for i in args.impls.split(",") if i] or None)
        with open(stem + ".json", "w", encoding="utf-8") as f:  # after every case: a cut-off run keeps its rows
            json.dump(result, f, indent=1)
    print(write_reports(stem + ".json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
