"""Deployment: compile a PyTorch model with tvm_ext, export it, and run the .so where only TVM's runtime is imported.

    python scripts/deploy_demo.py --model bert-tiny --target llvm --out out/deploy [--database LOG]

Step 1 (this process): `tvm_ext.from_torch` -> `tvm_ext.build` -> `tvm_ext.export` writes
OUT/MODEL.so, and the input and PyTorch's output go to OUT/MODEL.npz. Step 2 (a fresh process,
`--run-only`): loads the .so with `tvm.runtime` alone, runs it on the saved input and compares with
PyTorch's output; it fails if anything of this project or PyTorch was imported. MODEL is a name from examples/torch_models.py (needs PyTorch).
"""

import argparse
import os
import subprocess
import sys

import numpy as np

COMPILER_SIDE = ("tvm_ext", "schedules", "search", "examples", "torch")  # (the tvm wheel imports all of tvm)


def run_only(so_path: str, data_path: str, device: str) -> int:
    """Load and run with TVM's runtime only; 0 when the output matches."""
    sys.modules["torch"] = None  # tvm_ffi imports PyTorch when it can: show the model runs without it
    import tvm.runtime  # noqa: PLC0415
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    dev = tvm.runtime.device(device)
    vm = VirtualMachine(tvm.runtime.load_module(so_path), dev)
    with np.load(data_path) as data:
        x, want = data["x"], data["want"]
    out = vm["main"](tvm.runtime.tensor(x, dev))
    got = (out if hasattr(out, "numpy") else out[0]).numpy()
    leaked = sorted(m for m, loaded in sys.modules.items() if loaded is not None and m.split(".")[0] in COMPILER_SIDE)
    error = float(np.abs(got.astype("float64") - want.astype("float64")).max())
    tolerance = 5e-2 if x.dtype == np.float16 else 1e-3
    print(f"runtime-only run of {so_path} on {device}: max abs error {error:.3g} vs PyTorch (tolerance {tolerance})")
    if leaked:
        print(f"deploy_demo: the runtime process imported compiler-side modules: {leaked[:5]}", file=sys.stderr)
        return 1
    return 0 if error <= tolerance else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--target", default="llvm", help="llvm, cuda or a JSON target dict")
    ap.add_argument("--out", default="out/deploy")
    ap.add_argument("--database", default=None, help="tuning log written by scripts/tune.py")
    ap.add_argument("--run-only", nargs=3, metavar=("SO", "NPZ", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_only:
        return run_only(*args.run_only)

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import json  # noqa: PLC0415

    import tvm  # noqa: F401,PLC0415  (before torch, see the field guide)
    import tvm_ext  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from examples.torch_models import make  # noqa: PLC0415

    target = json.loads(args.target) if args.target.startswith("{") else args.target
    device = "cpu" if tvm_ext.parse_target(target).kind.name == "llvm" else "cuda"
    module, x = make(args.model)
    with torch.no_grad():
        want = module(x)
    executable = tvm_ext.build(tvm_ext.from_torch(module, x), target, database=args.database)
    os.makedirs(args.out, exist_ok=True)
    so_path = tvm_ext.export(executable, os.path.join(args.out, f"{args.model}.so"))
    data_path = os.path.join(args.out, f"{args.model}.npz")
    np.savez(data_path, x=x.numpy(), want=want.numpy())
    print(f"exported {so_path}")
    return subprocess.call([sys.executable, os.path.abspath(__file__), "--run-only", so_path, data_path, device])


if __name__ == "__main__":
    sys.exit(main())
