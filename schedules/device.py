"""Device facts the templates size themselves by, read from the target (never from a live GPU)."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

# Streaming multiprocessors per architecture, for the parts of the heuristics that count waves.
# Read from the target when it carries it; this table is the fallback for bare `{"kind": "cuda"}`.
_SM_COUNT = {"sm_70": 80, "sm_75": 40, "sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132}
# Shared memory per SM, and the most one block may opt in to (CUDA's tuning guides), in KB.
_SMEM_PER_SM = {"sm_70": 96, "sm_75": 64, "sm_80": 164, "sm_86": 100, "sm_89": 100, "sm_90": 228, "sm_100": 228}
_SMEM_PER_BLOCK = {"sm_70": 96, "sm_75": 64, "sm_80": 163, "sm_86": 99, "sm_89": 99, "sm_90": 227, "sm_100": 227}


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    max_threads: int
    warp: int
    smem_bytes: int  # static shared memory a block may use
    sm_count: int
    threads_per_sm: int = 2048  # resident threads per SM (sm_70 .. sm_90)
    registers_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024  # a block also costs 1 KB the driver reserves
    smem_opt_in: int = 227 * 1024  # the most dynamic shared memory a block may opt in to
    wgmma: bool = False  # warpgroup tensor-core instructions: sm_90a targets only
    compute: int = 0  # compute capability x 10 (sm_90a: 90); 0 for CPUs

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def resident_blocks(self, threads: int, registers: int = 0, smem: int = 0) -> int:
        """Blocks of `threads` one SM holds at once (32 at most), given registers per thread
        (allocated in multiples of 8) and shared memory per block where known."""
        limits = [32, self.threads_per_sm // threads]
        if registers:
            limits.append(self.registers_per_sm // (-(-registers // 8) * 8 * threads))
        if smem:
            limits.append(self.smem_per_sm // (smem + 1024))
        return max(1, min(limits))


def _attr(target: Target, name: str, default: int) -> int:
    value = target.attrs.get(name, None)
    return int(value) if value is not None else default


def device_of(target: Target) -> Device:
    if target.kind.name != "cuda":
        return Device("cpu", 1, 1, 0, _attr(target, "num-cores", 1))
    full_arch = str(target.attrs.get("arch", "sm_90"))
    arch = full_arch.rstrip("a")
    return Device(
        kind="cuda",
        max_threads=_attr(target, "max_num_threads", 1024),
        warp=_attr(target, "thread_warp_size", 32),
        smem_bytes=_attr(target, "max_shared_memory_per_block", 48 * 1024),
        sm_count=_attr(target, "multi_processor_count", _SM_COUNT.get(arch, 80)),
        wgmma=full_arch == "sm_90a",
        compute=int(arch[3:]) if arch[3:].isdigit() else 0,
        smem_per_sm=_SMEM_PER_SM.get(arch, 228) * 1024,
        smem_opt_in=_SMEM_PER_BLOCK.get(arch, 64) * 1024,  # unknown: what rows were staged in before
    )
