"""Last fixes to generated CUDA source, through TVM's codegen hook `tvm_callback_cuda_postproc`.

Chains to any hook registered earlier, then includes <cooperative_groups.h> where a kernel calls
the grid barrier, renames dynamic shared-memory arrays that two kernels of one source declare
with different element types (nvcc rejects the clash), and spells out 8-lane float32 vectors made
from lanes (see float8_vectors)."""

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


_MAKE_LONGS = "make_ulonglong4("
FLOAT8 = "tvm_ext_make_float8"
_FLOAT8_HELPER = f"""
__device__ __forceinline__ ulonglong4 {FLOAT8}(float a, float b, float c, float d, float e, float f, float g,
                                                 float h) {{
  ulonglong4 v;
  float2* lanes = (float2*)(&v);
  lanes[0] = make_float2(a, b); lanes[1] = make_float2(c, d); lanes[2] = make_float2(e, f); lanes[3] = make_float2(g, h);
  return v;
}}
"""


def _arguments(code: str, start: int) -> tuple[int, int]:
    """(top-level argument count, index after the closing parenthesis) of the call whose argument
    list opens at `start` (just after its "(")."""
    depth, count, i = 1, 1, start
    while depth:
        ch = code[i]
        depth += (ch == "(") - (ch == ")")
        count += ch == "," and depth == 1
        i += 1
    return count, i


def float8_vectors(code: str) -> str:
    """TVM 0.27's CUDA codegen holds 8 float32 lanes in a ulonglong4 (8 floats' bytes) but makes one
    from lanes as make_ulonglong4(8 floats), which takes 4 integers: nvcc rejects it. Such calls become
    tvm_ext_make_float8, which packs the 8 floats bit for bit (what the codegen's lane accesses,
    ((float2*)(&v.x))->y and so on, then read)."""
    found, i = [], code.find(_MAKE_LONGS)
    while i >= 0:
        count, end = _arguments(code, i + len(_MAKE_LONGS))
        if count == 8:
            found.append(i)
        i = code.find(_MAKE_LONGS, end)
    if not found:
        return code
    for i in reversed(found):
        code = code[:i] + FLOAT8 + "(" + code[i + len(_MAKE_LONGS):]
    at = max(0, code.find('extern "C" __global__'))  # before the first kernel (or its declaration)
    return code[:at] + _FLOAT8_HELPER + code[at:]


def register_source_hook() -> None:
    earlier = tvm_ffi.get_global_func("tvm_callback_cuda_postproc", allow_missing=True)

    def postproc(code, target):
        code = earlier(code, target) if earlier is not None else code
        return ours(code, target)

    ours = fallback.guarded_hook(lambda code, _target: float8_vectors(unique_dynamic_shared(with_header(code))),
                                 "CUDA source hook")
    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", postproc, override=True)
