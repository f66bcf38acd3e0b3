"""The main job: compile the example model with tvm_ext, export it, load it back, check it.

    python scripts/demo.py [--out out/]

Always for the LLVM CPU target; also for CUDA when a GPU is visible (run there), or, without a
GPU, when nvcc is installed (compiled to a cubin, not run). Exits non-zero on any mismatch.
"""

import argparse
import os
import shutil
import sys
import time

import numpy as np
import tvm
from tvm.support import nvcc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tvm_ext  # noqa: E402
from examples import transformer_norms as model  # noqa: E402

ROWS = [1, 77, 300]


def check(so_path: str, device) -> bool:
    vm = tvm_ext.load(so_path, device)
    ok = True
    rng = np.random.default_rng(0)
    for rows in ROWS:
        arrays = model.inputs(rows, rng)
        outs = vm["main"](*[tvm.runtime.tensor(a, device) for a in arrays])
        errs = [float(np.abs(o.numpy() - r).max()) for o, r in zip(outs, model.reference(*arrays))]
        good = max(errs) < 1e-3
        ok &= good
        print(f"    n={rows:4d}: max abs error per output {', '.join(f'{e:.1e}' for e in errs)}  {'ok' if good else 'WRONG'}")
    return ok


def run(target, device, out_dir: str) -> bool:
    name = target if isinstance(target, str) else target["kind"]
    t0 = time.time()
    executable = tvm_ext.build(model.build_module(), target)
    so = tvm_ext.export(executable, os.path.join(out_dir, f"transformer_norms_{name}.so"))
    print(f"  {name}: built and exported {so} in {time.time() - t0:.1f}s; "
          f"kernels: {', '.join(tvm_ext.cuda_kernels(executable)) or '(CPU functions)'}")
    return check(so, device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"tvm_ext {tvm_ext.__version__} on TVM {tvm.__version__}: example model {model.__name__}")
    ok = run("llvm", tvm.cpu(), args.out)
    if tvm.cuda(0).exist:
        ok &= run("cuda", tvm.cuda(0), args.out)
    elif shutil.which("nvcc"):
        target = {"kind": "cuda", "arch": "sm_90"}
        src = tvm_ext.cuda_source(tvm_ext.build(model.build_module(), target))
        with tvm_ext.parse_target(target):
            cubin = nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
        print(f"  cuda (no GPU here): sm_90 source compiled by nvcc to a {len(cubin)}-byte cubin; not run")
    else:
        print("  cuda: no GPU and no nvcc here; skipped")
    print("demo: all outputs match NumPy" if ok else "demo: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
