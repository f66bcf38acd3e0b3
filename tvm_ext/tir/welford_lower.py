"""WelfordLower: the Welford reciprocal 1/max(n, 1) as CUDA's fast approximate reciprocal.

The Welford legalization (tvm_ext/relax/welford.py) gives TVM one comm-reducer whose combine rule
serves both halves of a GPU reduction: TVM's cross-thread lowering (warp shuffles, one shared
memory round, and our grid templates) merges per-thread states by the parallel rule, and each
thread's serial loop merges single elements, where the same rule simplifies to the streaming
update mean_k = mean + (x - mean) / k;  M2_k = M2 + (x - mean) * (x - mean_k).

What is left to lower is the one reciprocal per element, 1 / max(n, 1): a float32 division that
CUDA compiles to the slow IEEE sequence unless --use_fast_math is on. This late-phase pass makes
it `__fdividef(1, n)` (rcp.approx.f32: at most 2 ulp, whatever the compile flags) in every CUDA
kernel. The pattern is the combine's own (a division of 1 by a max with 1); no other division
is touched.
"""

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
