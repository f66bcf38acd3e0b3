"""Builder: schedule and compile one candidate into a shared library, in a worker process."""

from __future__ import annotations

import os
import tempfile

import tvm


def build_candidate(func_json: str, target_json: str, knobs: dict, out_dir: str) -> tuple[str, list]:
    """Schedule and compile one candidate; (library path, shapes of the zero-filled inputs it needs)."""
    from tvm_ext import schedules  # noqa: PLC0415  (imports here: this runs in a fresh worker)
    import tvm_ext  # noqa: F401,PLC0415  (registers our reducers, passes and source hook)
    from tvm_ext.schedules.contracts import ZEROED_INPUTS  # noqa: PLC0415
    from tvm_ext.tir import TIR_PIPELINE  # noqa: PLC0415

    func, target = tvm.ir.load_json(func_json), tvm.target.Target(target_json)
    sch = schedules.schedule(func, target, knobs)
    if sch is None:
        raise ValueError(f"the template refuses knobs {knobs}")
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=target, tir_pipeline=TIR_PIPELINE)
    fd, path = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    lib.export_library(path)
    return path, [(list(shape), dtype) for shape, dtype in (scheduled.attrs or {}).get(ZEROED_INPUTS, [])]
