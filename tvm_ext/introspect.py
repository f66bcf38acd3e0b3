"""Look inside a built executable: the generated CUDA source and its kernels."""

from __future__ import annotations

import re

_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(')


def _modules(mod, kind):
    found = [mod] if mod.kind == kind else []
    for sub in mod.imports:
        found += _modules(sub, kind)
    return found


def cuda_source(executable) -> str:
    """All CUDA C++ the executable carries ("" for a CPU build)."""
    return "\n".join(m.inspect_source("cuda") for m in _modules(executable.mod, "cuda"))


def cuda_kernels(executable) -> list[str]:
    """Names of the device kernels, each once (the source declares then defines each)."""
    return sorted(set(_KERNEL.findall(cuda_source(executable))))
