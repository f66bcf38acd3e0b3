"""Programmatic dependent launch (sm_90+): each kernel is launched while the one before it retires.

The late pass puts `griddepcontrol.wait` at the top of every CUDA kernel, so no access runs ahead
of its predecessor, and tags it for programmatic stream serialization. Dependents are triggered
only by block exit. Cooperative kernels are left alone: a waiting kernel's blocks could keep them
from being co-resident. See docs/design.md#row-and-column-templates."""

from __future__ import annotations

import re

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .cooperative_launch import COOPERATIVE_LAUNCH, LAUNCH_PARAMS, with_launch_tag

DEPENDENT_LAUNCH = "tirx.use_programtic_dependent_launch"
MIN_ARCH = 90  # griddepcontrol needs sm_90


def supports_dependent_launch(target) -> bool:
    arch = re.fullmatch(r"sm_(\d+)[a-z]?", str(target.attrs.get("arch", ""))) if target.kind.name == "cuda" else None
    return arch is not None and int(arch.group(1)) >= MIN_ARCH


def _with_wait(body: tirx.Stmt) -> tirx.Stmt:
    """`body` with the wait placed inside its thread bindings, before anything else."""
    if isinstance(body, tirx.AttrStmt) and body.attr_key == "thread_extent":
        return tirx.AttrStmt(body.node, body.attr_key, body.value, _with_wait(body.body))
    return tirx.SeqStmt([tirx.Evaluate(T.ptx["griddepcontrol.wait"]()), body])


@tvm.transform.module_pass(opt_level=0, name="TVMExtDependentLaunch")
def dependent_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each device kernel for sm_90+, cooperative ones aside: the wait first, and the launch tag."""
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or not func.attrs:
            continue
        params, target = func.attrs.get(LAUNCH_PARAMS, None), func.attrs.get("target", None)
        if params is None or target is None or not supports_dependent_launch(target):
            continue  # host functions, CPU kernels, GPUs before sm_90
        if {COOPERATIVE_LAUNCH, DEPENDENT_LAUNCH} & {str(t) for t in params}:
            continue
        tags = with_launch_tag(params, DEPENDENT_LAUNCH)
        mod[gv] = func.with_body(_with_wait(func.body)).with_attr(LAUNCH_PARAMS, tags)
    return mod
