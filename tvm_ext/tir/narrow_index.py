"""The int32 rewrite of the kernels narrowing.py marked safe for it (early TIR phase).

Cross-thread reductions are lowered first (TVM's LowerCrossThreadReduction, which the default
lowering would run next anyway): TVM's ForceNarrowIndexToInt32 folds `x + 0.0` while it rebuilds
expressions, and a Welford update so folded no longer matches its registered reducer.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .narrowing import NARROW


@tvm.transform.module_pass(opt_level=0, name="TVMExtNarrowIndex")
def narrow_index(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and func.attrs.get(NARROW, False):
            single = tvm.IRModule({gv: func})
            single = tirx.transform.ForceNarrowIndexToInt32()(s_tir.transform.LowerCrossThreadReduction()(single))
            mod[gv] = single[gv]
    return mod
