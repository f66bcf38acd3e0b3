"""Grid-wide barriers in TIR: the cooperative launch they need and the header they call into.

A template writes the barrier as `T.call_extern("void", schedules.contracts.GRID_SYNC)`. The late
pass tags each kernel calling it for `cuLaunchCooperativeKernel` (all blocks resident, or refused);
the tag travels with exported modules. `with_header` adds <cooperative_groups.h> via source_hook."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from tvm_ext.schedules.contracts import GRID_SYNC, extern_name

COOPERATIVE_LAUNCH = "tirx.use_cooperative_launch"
DYNAMIC_SHARED_MEMORY = "tirx.use_dyn_shared_memory"  # TVM requires this tag to stay last
LAUNCH_PARAMS = "tirx.kernel_launch_params"
HEADER = "#include <cooperative_groups.h>\n"


def calls_grid_sync(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.Call, lambda e: found.append(e) if extern_name(e) == GRID_SYNC else None),
                            order="pre")
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="TVMExtCooperativeLaunch")
def cooperative_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Tag each device kernel that calls the grid barrier for a cooperative launch."""
    for gv, func in list(mod.functions_items()):
        params = isinstance(func, tirx.PrimFunc) and func.attrs and func.attrs.get(LAUNCH_PARAMS, None)
        if params is None or not calls_grid_sync(func) or COOPERATIVE_LAUNCH in params:
            continue
        mod[gv] = func.with_attr(LAUNCH_PARAMS, with_launch_tag(params, COOPERATIVE_LAUNCH))
    return mod


def with_launch_tag(params, tag: str) -> list[str]:
    """Launch params `params` with `tag` added, before the dynamic shared memory tag TVM wants last."""
    tags = [str(t) for t in params]
    last = [DYNAMIC_SHARED_MEMORY] if DYNAMIC_SHARED_MEMORY in tags else []
    return [t for t in tags if t != DYNAMIC_SHARED_MEMORY] + [tag] + last


def with_header(code: str) -> str:
    """`code` with <cooperative_groups.h> included where it calls the grid barrier."""
    return HEADER + code if GRID_SYNC + "()" in code and HEADER not in code else code
