"""`build` and `export`: the compile-time half of the public API (`load` lives in runtime.py)."""

from __future__ import annotations

import logging
import os

import tvm
from tvm import relax

from .tir.intrinsics import import_tensor_intrinsics
from .tir import TIR_PIPELINE
from .pipeline import tvm_ext_pipeline
from .records import Database
from .target import parse_target

logger = logging.getLogger(__name__)


def _check_module(mod) -> None:
    if not isinstance(mod, tvm.IRModule):
        raise ValueError(f"expected a tvm.IRModule holding a Relax function 'main', got {type(mod).__name__}")
    mains = [gv for gv in mod.get_global_vars() if gv.name_hint == "main"]
    if not mains or not isinstance(mod[mains[0]], relax.Function):
        raise ValueError("the module has no Relax function 'main' to compile")


def build(mod: tvm.IRModule, target, database=None, **options):
    """Compile a Relax module with the tvm_ext pipeline; returns a `relax.VMExecutable`.

    `target`: a Target, a JSON dict, "cuda" (this machine's GPU) or "llvm".
    `database`: path of a tuning log written by scripts/tune.py, or None for heuristic schedules;
    how many functions took one of its records is logged, and a log none matched is a warning.
    """
    _check_module(mod)
    target = parse_target(target)
    if "gpu" in target.keys:
        import_tensor_intrinsics()  # dlight's matmul rule would import them, 10-25x slower
    if database is not None and not isinstance(database, Database):
        database = Database.load(database)
    pipeline = tvm_ext_pipeline(database, **options)
    executable = tvm.compile(mod, target=target, relax_pipeline=pipeline, tir_pipeline=TIR_PIPELINE)
    if database is not None:
        logger.info("tvm_ext: %d of %d task(s) took a record of tuning log %s", len(database.taken),
                    len(database.asked), database.path)
        database.warn_if_unmatched()
    return executable


def export(executable, path: str | os.PathLike) -> str:
    """Write `executable` as a shared library that `tvm_ext.load` (or plain TVM runtime) can load."""
    path = os.fspath(path)
    if not path.endswith(".so"):
        raise ValueError(f"export path {path!r} must end in .so")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"directory {parent!r} for the exported model does not exist")
    tmp = path + ".tmp.so"  # write aside, then rename: a failed export never clobbers a good one
    executable.export_library(tmp)
    os.replace(tmp, path)
    return path
