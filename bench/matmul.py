"""Tensor-core matmuls from the thread-level template: ours (template + auto-tensorization) against
cuBLAS, TVM dlight's Matmul rule and the same schedule without the pass, in one run on this GPU.

    python -m bench.matmul --out bench/results/h200-DATE-matmul [--shapes 4096x4096x4096,...] [--dtype int8]

For each (M, N, K): a few template tilings are built with the pass and the fastest is reported;
"plain" is that same tiling without the pass; "tvm_ext.build" is the whole pipeline on the Relax
matmul (the template's heuristic tiling). Ours and plain write fp32 (the template's
accumulator); cuBLAS (`torch.matmul`) and the anchors are fp16 in and out; dlight builds the same
fp16 -> fp32 Relax matmul with TVM's default pipeline. Every output is checked against cuBLAS.
With --dtype int8 the operands are int8 and every product int32, against cuBLAS's `torch._int_mm`
(TOPS instead of TFLOP/s); the check is then exact.
"""

from __future__ import annotations

import argparse

import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.report import write_json_and_markdown
from bench.spelled import main_module
from tvm_ext.schedules import matmul, wgmma_matmul
from tvm_ext.schedules.device import device_of
from tvm_ext.target import without_arch_specific
from tvm_ext.tir.tensorize import auto_tensorize

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16, 4096, 4096), (1024, 11008, 4096), (4096, 1000, 1024)]


def relax_matmul(m: int, n: int, k: int, dtype: str = "float16", out: str = "float32") -> tvm.IRModule:
    a, b = relax.Var("a", relax.TensorType([m, k], dtype)), relax.Var("b", relax.TensorType([k, n], dtype))
    return main_module(lambda bb, a, b: relax.op.matmul(a, b, out_dtype=out), [a, b])


def template_func(m: int, n: int, k: int, dtype: str = "float16", out: str = "float32"):
    """The legalized matmul PrimFunc the template schedules."""
    mod = relax.transform.LegalizeOps()(relax_matmul(m, n, k, dtype, out))
    return next(f for gv, f in mod.functions_items() if gv.name_hint != "main")


def build(func, knobs: dict, tensorize: bool, target, template=matmul):
    sch = template.apply(func, knobs)
    if sch is None:
        return None
    scheduled = sch.mod["main"]
    scheduled = auto_tensorize(scheduled) if tensorize else scheduled
    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):  # pipelined copies: cp.async
        lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
    return lambda a, b, c: lib["main"](*[tvm.runtime.from_dlpack(x) for x in (a, b, c)])


def tflops(m, n, k, us) -> float:
    return 2 * m * n * k / us / 1e6


ACCUMULATOR = {"float16": "float32", "int8": "int32"}


def run_shape(m: int, n: int, k: int, target, dtype: str = "float16") -> dict:
    """One shape: cuBLAS, the thread-level template with and without the pass (each tiling, the
    best kept), the wgmma template (each tile, when `target` is sm_90a), dlight (on sm_90: on sm_90a
    dlight leaves the tensor cores out) and the whole pipeline on `target`."""
    import torch  # noqa: PLC0415 (after tvm, as the field guide says; the CPU tests import this module)
    from triton.testing import do_bench  # noqa: PLC0415

    if dtype == "int8":
        a = torch.randint(-64, 64, (m, k), device="cuda", dtype=torch.int8)
        b = torch.randint(-64, 64, (k, n), device="cuda", dtype=torch.int8)
        cublas = torch._int_mm  # int8 x int8 -> int32 on the tensor cores
    else:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        cublas = torch.matmul
    want = cublas(a, b)
    row = {"shape": [m, n, k], "dtype": dtype, "cublas_us": do_bench(lambda: cublas(a, b), return_mode="median") * 1e3}
    c = torch.empty(m, n, device="cuda", dtype=getattr(torch, ACCUMULATOR[dtype]))

    def timed(fn):
        c.fill_(float("nan") if c.is_floating_point() else -7)  # what no correct kernel leaves
        fn(a, b, c)
        err = float((c.double() - want.double()).abs().max() / want.double().abs().max())
        return do_bench(lambda: fn(a, b, c), return_mode="median") * 1e3, err

    func = template_func(m, n, k, dtype, ACCUMULATOR[dtype])
    tried = []
    for tiling in matmul.TILINGS:
        knobs = matmul.tiling_knobs(*tiling, itemsize=1 if dtype == "int8" else 2)
        fn = build(func, knobs, True, target)
        if fn is not None:
            us, err = timed(fn)
            tried.append({"knobs": knobs, "us": us, "err": err})
    def fastest(points):  # the fastest correct point: within fp16 rounding, int8 exact
        good = [t for t in points if t["err"] < 1e-2 if dtype == "float16" or t["err"] == 0]
        return min(good, key=lambda t: t["us"], default=None)

    best = fastest(tried)
    if best:
        row.update(ours_us=best["us"], ours_err=best["err"], knobs=best["knobs"])
        row["plain_us"], row["plain_err"] = timed(build(func, best["knobs"], False, target))
    else:
        row["ours_error"] = "no tiling of the template fits this shape" if not tried else "wrong results"
    warpgroup = []
    for knobs in wgmma_matmul.knob_space(func) if device_of(target).wgmma else []:
        us, err = timed(build(func, knobs, False, target, wgmma_matmul))
        warpgroup.append({"knobs": knobs, "us": us, "err": err})
    best = fastest(warpgroup)
    if best:
        row.update(wgmma_us=best["us"], wgmma_err=best["err"], wgmma_knobs=best["knobs"])
    relax_mod = relax_matmul(m, n, k, dtype, ACCUMULATOR[dtype])
    for impl, executable in (("dlight", lambda: tvm.compile(relax_mod, target=without_arch_specific(target))),
                             ("pipeline", lambda: tvm_ext.build(relax_mod, target))):
        try:
            main = VirtualMachine(executable(), tvm.cuda())["main"]
            out = main(tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b))
        except Exception as err:  # one failing implementation must not sink the table
            row[f"{impl}_error"] = str(err).splitlines()[0][:200]
            continue
        got = torch.from_dlpack(out).double()
        row[f"{impl}_err"] = float((got - want.double()).abs().max() / want.double().abs().max())
        row[f"{impl}_us"] = do_bench(lambda: main(tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(b)),
                                     return_mode="median") * 1e3
    row["tried"], row["wgmma_tried"] = tried, warpgroup
    return row


def table(rows: list, device: str) -> str:
    int8 = rows and rows[0].get("dtype") == "int8"
    what = ("TOPS = 2MNK / median time. int8 in, int32 out (cuBLAS: torch._int_mm)." if int8 else
            "TFLOP/s = 2MNK / median time. Ours and plain: fp16 in, fp32 out; cuBLAS: fp16 in/out.")
    lines = [f"{device}; {what}", "",
             "| M x N x K | cuBLAS | ours (pass) | plain (no pass) | dlight | wgmma | tvm_ext.build | ours / cuBLAS | "
             "ours / dlight | ours / plain | wgmma / cuBLAS | wgmma / dlight | tvm_ext.build / cuBLAS | "
             "tiling (bm, wm, bn, bk, stages) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, n, k = r["shape"]
        f = {key: tflops(m, n, k, r[f"{key}_us"]) for key in ("cublas", "ours", "plain", "dlight", "wgmma", "pipeline")
             if f"{key}_us" in r}
        t = r.get("knobs", {})
        ours, built = f.get("ours"), f.get("pipeline")
        lines.append(f"| {m}x{n}x{k} | {f['cublas']:.0f} | {ours and f'{ours:.0f}' or r.get('ours_error')} | "
                     f"{f.get('plain', float('nan')):.0f} | {f.get('dlight', float('nan')):.0f} | "
                     f"{f.get('wgmma', float('nan')):.0f} | {built and f'{built:.0f}' or r.get('pipeline_error', '-')} | "
                     + " | ".join(f"{ours / f[x]:.2f}x" if ours and x in f else "-" for x in ("cublas", "dlight", "plain"))
                     + " | " + " | ".join(f"{f['wgmma'] / f[x]:.2f}x" if "wgmma" in f and x in f else "-"
                                          for x in ("cublas", "dlight"))
                     + (f" | {built / f['cublas']:.2f}x" if built else " | -"))
        lines[-1] += f" | {t and (t['block_m'], t['warp_m'], t['block_n'], t['block_k'], t['stages'])} |"
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    ap.add_argument("--shapes", default="", help="comma-separated MxNxK (default: the issue's five)")
    ap.add_argument("--dtype", default="float16", choices=sorted(ACCUMULATOR), help="operand type")
    args = ap.parse_args(argv)
    import torch  # noqa: PLC0415

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    target = tvm_ext.parse_target("cuda")
    rows, device = [], torch.cuda.get_device_name()
    for shape in shapes:  # written after each shape: a run cut short keeps what it measured
        rows.append(run_shape(*shape, target, args.dtype))
        print(rows[-1] | {"tried": len(rows[-1]["tried"])}, flush=True)
        write_json_and_markdown(args.out, {"device": device, "rows": rows}, table(rows, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
