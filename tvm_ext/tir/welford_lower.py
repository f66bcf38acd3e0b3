"""WelfordLower: the Welford reciprocal 1/max(n, 1) as CUDA's fast approximate reciprocal.

Each thread's serial Welford merge has one float32 division per element, compiled to the slow IEEE
sequence without --use_fast_math. This late pass makes it `__fdividef(1, n)` (at most 2 ulp) in
every CUDA kernel; only the combine's own pattern (1 divided by a max with 1) is touched."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx


def _is_welford_reciprocal(div: tirx.Div) -> bool:
    one = lambda e: isinstance(e, tirx.FloatImm) and e.value == 1.0  # noqa: E731
    return (div.ty.dtype == "float32" and one(div.a) and isinstance(div.b, tirx.Max)
            and (one(div.b.a) or one(div.b.b)))


def _fast_reciprocal(div: tirx.Div):
    if not _is_welford_reciprocal(div):
        return div
    return tirx.call_pure_extern("float32", "__fdividef", div.a, div.b)


@tvm.transform.module_pass(opt_level=0, name="TVMExtWelfordLower")
def welford_lower(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions_items()):
        target = isinstance(func, tirx.PrimFunc) and func.attrs and func.attrs.get("target", None)
        if target is not None and target.kind.name == "cuda":
            mod[gv] = func.with_body(tvm_ffi.structural_map(func.body, (tirx.Div, _fast_reciprocal)))
    return mod
