"""Programmatic dependent launch: each kernel on Hopper is launched while the one before it retires.

Between two kernels of one stream the GPU normally waits for the first grid to finish, flush its
memory and retire before it launches the second: about 1.5 us per boundary, 20 us across the 12
kernels of a LLaMA layer at seq 512 (bench/timeline.py). On sm_90 a kernel launched with
"programmatic stream serialization" may be launched once every block of the kernel before it has
executed `griddepcontrol.launch_dependents` or exited; it must then execute `griddepcontrol.wait`,
which returns once that kernel has completed and its writes are visible, before it touches memory.

This late-phase pass gives every CUDA kernel for sm_90 or newer the wait at the top of its body,
so no access can run ahead of the kernel before, and the launch tag
"tirx.use_programtic_dependent_launch" (TVM's spelling), with which TVM's CUDA runtime launches it
through cuLaunchKernelEx with that attribute. The tag travels with an exported module. Since each
kernel waits for the one before it to complete, and that one waited for its own predecessor, every
kernel still sees all earlier writes. No kernel triggers its dependents early: each block's exit
does. A trigger at the top of every kernel (the next kernel's blocks resident while this one runs)
measured slower on every model, and so did matmuls loading their weights before the wait
(bench/results/h200-2026-11-24-s15-trigger-placement-ab.json, -s15-weights-early-ab.json).
Kernels launched cooperatively (grid barrier) are left as they are: their blocks must all be
resident at once, which blocks of a waiting kernel could prevent.
"""

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
