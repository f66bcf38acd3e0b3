"""Turn what users pass as `target` into a `tvm.target.Target` with an LLVM host."""

from __future__ import annotations

import functools
import re

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


@functools.cache
def known_cuda_archs() -> tuple[str, ...]:
    """`sm_XY` of every GPU in TVM's nvidia tags (sm_20 ... sm_120), without arch-specific suffixes."""
    archs = {re.fullmatch(r"sm_(\d+)[af]?", str(t.attrs["arch"]))[1] for t in tvm.target.list_tags().values()
             if t.kind.name == "cuda" and "arch" in t.attrs}
    return tuple(f"sm_{n}" for n in sorted(archs, key=int))


def check_cuda_arch(arch: str) -> str:
    """`arch` if it is a known architecture (optionally arch-specific, 'a' / 'f': sm_90a); ValueError
    naming it and the known ones otherwise: TVM accepts any sm_ number and nvcc fails much later."""
    found = re.fullmatch(r"(sm_\d+)[af]?", arch)
    if found is None or found[1] not in known_cuda_archs():
        raise ValueError(f"unknown CUDA arch {arch!r}: expected one of {', '.join(known_cuda_archs())} "
                         "(with 'a' for arch-specific instructions, e.g. 'sm_90a')")
    return arch


def cuda_target(arch: str) -> Target:
    return Target({"kind": "cuda", "arch": arch, **_CUDA_LIMITS}, host=HOST)


def parse_target(target) -> Target:
    """Accept a Target, a JSON dict, 'cuda' (this machine's GPU) or 'llvm'; ValueError otherwise,
    also for a CUDA arch that no GPU has."""
    parsed = _parse_target(target)
    if parsed.kind.name == "cuda":
        check_cuda_arch(str(parsed.attrs["arch"]))
    return parsed


def _parse_target(target) -> Target:
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


# What an LLVM CPU target needs of the CPU, as /proc/cpuinfo flags: code using a feature the CPU
# lacks dies with SIGILL. By -mcpu (a CPU not listed, e.g. "generic", TVM's default, needs none)...
_AVX2 = ("avx2",)
_AVX512 = _AVX2 + ("avx512f",)
_AVX512_BF16 = _AVX512 + ("avx512_bf16",)
_MCPU_FLAGS = {
    **dict.fromkeys(("haswell", "broadwell", "skylake", "alderlake", "raptorlake", "meteorlake", "znver1", "znver2",
                     "znver3", "x86-64-v3"), _AVX2),
    **dict.fromkeys(("skylake-avx512", "cascadelake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                     "x86-64-v4"), _AVX512),
    **dict.fromkeys(("cooperlake", "znver4", "znver5"), _AVX512_BF16),
    **dict.fromkeys(("sapphirerapids", "emeraldrapids", "graniterapids"), _AVX512_BF16 + ("avx512_fp16", "amx_tile")),
}
# ... and by -mattr feature (x86, then Arm); features not listed are not checked.
_MATTR_FLAGS = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avxvnni": "avx_vnni", "avx512f": "avx512f",
                "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni",
                "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile",
                "amx-bf16": "amx_bf16", "amx-int8": "amx_int8", "sve": "sve", "sve2": "sve2", "bf16": "bf16",
                "i8mm": "i8mm", "dotprod": "asimddp", "fullfp16": "asimdhp"}


def cpu_flags(llvm_target: dict) -> list[str]:
    """The /proc/cpuinfo flags an LLVM target's code may use (of those `_MCPU_FLAGS` and
    `_MATTR_FLAGS` know): its -mcpu's, plus its '+feature's, less its '-feature's."""
    flags = set(_MCPU_FLAGS.get(str(llvm_target.get("mcpu", "")), ()))
    for attr in llvm_target.get("mattr", []):
        flag = _MATTR_FLAGS.get(attr[1:])
        if flag is not None and attr[0] in "+-":
            (flags.add if attr[0] == "+" else flags.discard)(flag)
    return sorted(flags)
