"""The main job: compile the example model with tvm_ext, export it, load it back, check it.

    tvm-ext-demo [--out out/]        (in the repository: python scripts/demo.py)

The model is the norm and softmax traffic of a transformer block, with a symbolic row count:
h = LayerNorm(x); p = Softmax(h); r = RMSNorm(x); s = rowsum(p * r).

Always for the LLVM CPU target; also for CUDA when a GPU is visible (run there), or, without a
GPU, when nvcc is installed (compiled to a cubin, not run). Exits non-zero on any mismatch.
"""

import argparse
import os
import shutil
import time

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.support import nvcc

import tvm_ext

ROWS = [1, 77, 300]
HIDDEN = 512


def build_module(dtype: str = "float32") -> tvm.IRModule:
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, HIDDEN], dtype))
    g, b, w = (relax.Var(name, relax.TensorType([HIDDEN], dtype)) for name in ("gamma", "beta", "w"))
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            p = bb.emit(relax.op.nn.softmax(h, axis=-1))
            r = bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-6))
            s = bb.emit(relax.op.sum(relax.op.multiply(p, r), axis=[1]))
            out = bb.emit_output(relax.Tuple([p, r, s]))
        bb.emit_func_output(out)
    return bb.get()


def inputs(rows: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((rows, HIDDEN)).astype("float32") * 3 + 1] + [
        rng.standard_normal(HIDDEN).astype("float32") for _ in range(3)]


def reference(x, g, b, w) -> list[np.ndarray]:
    x, g, b, w = (a.astype("float64") for a in (x, g, b, w))
    h = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    e = np.exp(h - h.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    r = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    return [p, r, (p * r).sum(1)]


def check(so_path: str, device) -> bool:
    vm = tvm_ext.load(so_path, device)
    ok = True
    rng = np.random.default_rng(0)
    for rows in ROWS:
        arrays = inputs(rows, rng)
        outs = vm["main"](*[tvm.runtime.tensor(a, device) for a in arrays])
        errs = [float(np.abs(o.numpy() - r).max()) for o, r in zip(outs, reference(*arrays))]
        good = max(errs) < 1e-3
        ok &= good
        print(f"    n={rows:4d}: max abs error per output {', '.join(f'{e:.1e}' for e in errs)}  {'ok' if good else 'WRONG'}")
    return ok


def run(target, device, out_dir: str) -> bool:
    name = target if isinstance(target, str) else target["kind"]
    t0 = time.time()
    executable = tvm_ext.build(build_module(), target)
    so = tvm_ext.export(executable, os.path.join(out_dir, f"transformer_norms_{name}.so"))
    print(f"  {name}: built and exported {so} in {time.time() - t0:.1f}s; "
          f"kernels: {', '.join(tvm_ext.cuda_kernels(executable)) or '(CPU functions)'}")
    return check(so, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(f"tvm_ext {tvm_ext.__version__} on TVM {tvm.__version__}: example model transformer_norms")
    ok = run("llvm", tvm.cpu(), args.out)
    if tvm.cuda(0).exist:
        ok &= run("cuda", tvm.cuda(0), args.out)
    elif shutil.which("nvcc"):
        target = {"kind": "cuda", "arch": "sm_90"}
        src = tvm_ext.cuda_source(tvm_ext.build(build_module(), target))
        with tvm_ext.parse_target(target):
            cubin = nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
        print(f"  cuda (no GPU here): sm_90 source compiled by nvcc to a {len(cubin)}-byte cubin; not run")
    else:
        print("  cuda: no GPU and no nvcc here; skipped")
    print("demo: all outputs match NumPy" if ok else "demo: MISMATCH")
    return 0 if ok else 1
