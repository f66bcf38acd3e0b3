"""Turn what users pass as `target` into a `tvm.target.Target` with an LLVM host."""

from __future__ import annotations

import tvm
from tvm.target import Target

HOST = {"kind": "llvm"}
ACCEPTED = "a tvm.target.Target, a JSON dict such as {'kind': 'cuda', 'arch': 'sm_90'}, or one of 'cuda', 'llvm'"

# What the nvidia tags carry, for any arch: dlight and our templates size blocks by these.
_CUDA_LIMITS = {"max_num_threads": 1024, "max_threads_per_block": 1024, "thread_warp_size": 32,
                "max_shared_memory_per_block": 49152}


def current_gpu_arch() -> str:
    """`sm_XY` of GPU 0 (`sm_90a` on Hopper: its arch-specific instructions, which the wgmma
    matmul template needs); ValueError when no CUDA GPU is visible to TVM."""
    dev = tvm.cuda(0)
    if not dev.exist:
        raise ValueError(
            "target 'cuda' means the current GPU's architecture, but no CUDA GPU is visible; "
            "pass an explicit target such as {'kind': 'cuda', 'arch': 'sm_90'}"
        )
    arch = "sm_" + dev.compute_version.replace(".", "")
    return arch + "a" if arch == "sm_90" else arch


def cuda_target(arch: str) -> Target:
    return Target({"kind": "cuda", "arch": arch, **_CUDA_LIMITS}, host=HOST)


def parse_target(target) -> Target:
    """Accept a Target, a JSON dict, 'cuda' (this machine's GPU) or 'llvm'; ValueError otherwise."""
    if isinstance(target, Target):
        return target if target.host is not None or target.kind.name == "llvm" else Target(target, host=HOST)
    if isinstance(target, str):
        if target == "llvm":
            return Target({"kind": "llvm"})
        if target == "cuda":
            return cuda_target(current_gpu_arch())
        raise ValueError(f"unsupported target string {target!r}: expected {ACCEPTED}")
    if isinstance(target, dict):
        spec = dict(target)
        if spec.get("kind") == "cuda":
            spec = {**_CUDA_LIMITS, **spec}
        try:
            return Target(spec, host=HOST) if spec.get("kind", "") != "llvm" else Target(spec)
        except Exception as err:  # TVM's message is a C++ trace; lead with what was passed
            raise ValueError(f"invalid target {target!r}: {str(err).splitlines()[-1]}") from None
    raise ValueError(f"unsupported target {target!r} of type {type(target).__name__}: expected {ACCEPTED}")


def without_arch_specific(target: Target) -> Target:
    """`target` on its architecture's portable variant (sm_90a -> sm_90): where TVM's own rules are
    compared (on sm_90a dlight leaves the tensor cores out) or our pipeline without wgmma."""
    arch = str(target.attrs["arch"]).removesuffix("a")
    return Target({**target.export(), "arch": arch}, host=target.host)
