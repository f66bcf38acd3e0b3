"""Direct convolutions from `schedules/conv2d.py` against TVM dlight's default, cuDNN in float32
and cuDNN with TF32 tensor cores (PyTorch's default for convolutions), in one run on this GPU.

    python -m bench.conv --out bench/results/h200-DATE-conv [--shapes 32x256x56x56x256] [--grid 60]

A shape is N x C x H x W x F (3x3 kernel, padding 1, float32). Each tiling of `conv2d.TILINGS` (and,
with --grid, that many more drawn at random from `conv2d.knob_space`, to choose TILINGS from) is
built and timed; the fastest correct one is reported. Every output is checked against PyTorch's
float32 convolution.
"""

from __future__ import annotations

import argparse
import random

import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.report import write_json_and_markdown
from bench.spelled import main_module
from tvm_ext.schedules import conv2d

SHAPES = [(32, 256, 56, 56, 256), (32, 128, 28, 28, 128), (32, 64, 56, 56, 64)]


def relax_conv(n, c, h, w, f) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType([n, c, h, w], "float32"))
    k = relax.Var("k", relax.TensorType([f, c, 3, 3], "float32"))
    return main_module(lambda bb, x, k: relax.op.nn.conv2d(x, k, padding=1), [x, k])


def conv_func(n, c, h, w, f):
    mod = relax.transform.LegalizeOps()(relax_conv(n, c, h, w, f))
    return next(fn for gv, fn in mod.functions_items() if gv.name_hint != "main")


def build(func, knobs: dict, target):
    sch = conv2d.apply(func, knobs)
    if sch is None:
        return None
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    return lambda *arrays: lib["main"](*[tvm.runtime.from_dlpack(a) for a in arrays])


def tflops(shape, us) -> float:
    n, c, h, w, f = shape
    return 2 * n * c * h * w * f * 9 / us / 1e6


def run_shape(shape, target, extra: list) -> dict:
    import torch  # noqa: PLC0415 (after tvm)
    from triton.testing import do_bench  # noqa: PLC0415

    n, c, h, w, f = shape
    x = torch.randn(n, c, h, w, device="cuda")
    k = torch.randn(f, c, 3, 3, device="cuda") / (3 * c ** 0.5)
    row = {"shape": list(shape)}
    for name, tf32 in (("cudnn_fp32", False), ("cudnn_tf32", True)):
        torch.backends.cudnn.allow_tf32 = tf32
        row[f"{name}_us"] = do_bench(lambda: torch.nn.functional.conv2d(x, k, padding=1), return_mode="median") * 1e3
    torch.backends.cudnn.allow_tf32 = False
    want = torch.nn.functional.conv2d(x, k, padding=1)
    out = torch.empty_like(want)

    def err():
        return float((out - want).abs().max() / want.abs().max())

    func, tried = conv_func(*shape), []
    for knobs in [conv2d.tiling_knobs(*t) for t in conv2d.TILINGS] + extra:
        try:
            fn = build(func, knobs, target)
        except Exception as e:  # a tiling TVM cannot lower costs one row, not the run
            tried.append({"knobs": knobs, "error": str(e).splitlines()[-1][:200]})
            continue
        if fn is None:
            continue
        out.fill_(float("nan"))
        fn(x, k, out)
        tried.append({"knobs": knobs, "err": err(), "us": do_bench(lambda: fn(x, k, out), return_mode="median") * 1e3})
    good = [t for t in tried if t.get("err", 1) < 1e-4]
    if good:
        best = min(good, key=lambda t: t["us"])
        row.update(ours_us=best["us"], ours_err=best["err"], knobs=best["knobs"])
    for impl, executable in (("dlight", lambda: tvm.compile(relax_conv(*shape), target=target)),
                             ("pipeline", lambda: tvm_ext.build(relax_conv(*shape), target))):
        main = VirtualMachine(executable(), tvm.cuda())["main"]
        args = [tvm.runtime.from_dlpack(a) for a in (x, k)]
        got = torch.from_dlpack(main(*args))
        row[f"{impl}_err"] = float((got - want).abs().max() / want.abs().max())
        row[f"{impl}_us"] = do_bench(lambda: main(*args), return_mode="median") * 1e3
    row["tried"] = tried
    return row


def table(rows: list, device: str) -> str:
    lines = [f"{device}; float32, 3x3 kernel, padding 1; TFLOP/s = 2 N C H W F 9 / median time.", "",
             "| N x C x H x W -> F | cuDNN fp32 | cuDNN TF32 | dlight | ours | tvm_ext.build | ours / dlight | "
             "ours / cuDNN fp32 | tiling (vf tf fi, vy ty yi, vx tx xi, rc) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = {key: tflops(r["shape"], r[f"{key}_us"]) for key in ("cudnn_fp32", "cudnn_tf32", "dlight", "ours", "pipeline")
             if f"{key}_us" in r}
        kn = r.get("knobs")
        tiling = kn and ", ".join(" ".join(str(kn[p + a] if p != "i" else kn[a + "i"]) for p in ("v", "t", "i"))
                                  for a in conv2d.AXES) + f", {kn['rc']}"
        lines.append(f"| {'x'.join(map(str, r['shape'][:4]))} -> {r['shape'][4]} | "
                     + " | ".join(f"{t[key]:.1f}" if key in t else "-" for key in ("cudnn_fp32", "cudnn_tf32", "dlight", "ours", "pipeline"))
                     + " | " + " | ".join(f"{t['ours'] / t[x]:.2f}x" if "ours" in t and x in t else "-" for x in ("dlight", "cudnn_fp32"))
                     + f" | {tiling or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    ap.add_argument("--shapes", default="", help="comma-separated NxCxHxWxF (default: three ResNet layers)")
    ap.add_argument("--grid", type=int, default=0, help="also try this many random tilings of conv2d.knob_space")
    args = ap.parse_args(argv)
    import torch  # noqa: PLC0415

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    target = tvm_ext.parse_target("cuda")
    rows, device = [], torch.cuda.get_device_name()
    for shape in shapes:
        grid = conv2d.knob_space(conv_func(*shape))
        extra = random.Random(0).sample(grid, min(args.grid, len(grid)))
        rows.append(run_shape(shape, target, extra))
        print({k: v for k, v in rows[-1].items() if k != "tried"}, flush=True)
        write_json_and_markdown(args.out, {"device": device, "rows": rows}, table(rows, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
