"""Last fixes to generated CUDA source, through TVM's codegen hook `tvm_callback_cuda_postproc`.

Chains to any hook registered earlier, then includes <cooperative_groups.h> where a kernel calls
the grid barrier, and renames dynamic shared-memory arrays that two kernels of one source declare
with different element types (nvcc rejects the clash)."""

from __future__ import annotations

import re

import tvm_ffi

from .. import fallback
from .cooperative_launch import with_header

_EXTERN_SHARED = re.compile(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];")
_KERNEL_START = re.compile(r'extern "C" __global__ void [^;{]*\{')


def unique_dynamic_shared(code: str) -> str:
    types: dict = {}
    for dtype, name in _EXTERN_SHARED.findall(code):
        types.setdefault(name, set()).add(dtype)
    clashing = [name for name, dtypes in types.items() if len(dtypes) > 1]
    if not clashing:
        return code
    starts = [m.start() for m in _KERNEL_START.finditer(code)] + [len(code)]
    pieces = [code[:starts[0]]]
    for k, (begin, end) in enumerate(zip(starts, starts[1:])):
        kernel = code[begin:end]
        for name in clashing:
            kernel = re.sub(rf"\b{name}\b", f"{name}_k{k}", kernel)
        pieces.append(kernel)
    return "".join(pieces)


def register_source_hook() -> None:
    earlier = tvm_ffi.get_global_func("tvm_callback_cuda_postproc", allow_missing=True)

    def postproc(code, target):
        code = earlier(code, target) if earlier is not None else code
        return ours(code, target)

    ours = fallback.guarded_hook(lambda code, _target: unique_dynamic_shared(with_header(code)), "CUDA source hook")
    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", postproc, override=True)
