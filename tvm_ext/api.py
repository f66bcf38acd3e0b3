"""`build` and `export`: the compile-time half of the public API (`load` lives in runtime.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import tempfile

import tvm
from tvm import relax

from . import __version__
from .introspect import _modules
from .pipeline import tvm_ext_pipeline
from .records import Database
from .runtime import file_sha256, manifest_trailer
from .target import cpu_flags, parse_target
from .tir import TIR_PIPELINE
from .tir.intrinsics import import_tensor_intrinsics

MIN_FREE_BYTES = 1 << 20  # less than this free where an export's write failed: the disk is full

logger = logging.getLogger(__name__)


def _check_module(mod) -> None:
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"build: mod must be a tvm.IRModule holding a Relax function 'main', got {type(mod).__name__}")
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
    if database is not None and not isinstance(database, (str, os.PathLike, Database)):
        raise TypeError(f"build: database must be the path of a tuning log (str or os.PathLike), a Database or None, "
                        f"got {type(database).__name__}")
    target = parse_target(target)
    if "gpu" in target.keys:
        import_tensor_intrinsics()  # dlight's matmul rule would import them, far slower
    if database is not None and not isinstance(database, Database):
        database = Database.load(database)
    pipeline = tvm_ext_pipeline(database, **options)
    executable = tvm.compile(mod, target=target, relax_pipeline=pipeline, tir_pipeline=TIR_PIPELINE)
    if database is not None:
        logger.info("tvm_ext: %d of %d task(s) took a record of tuning log %s", len(database.taken),
                    len(database.asked), database.path)
        database.warn_if_unmatched()
    executable.tvm_ext_target = target  # for export's manifest: the CUDA arch is not readable from the module
    return executable


def export(executable, path: str | os.PathLike) -> str:
    """Write `executable` as a shared library that `tvm_ext.load` (or plain TVM runtime) can load,
    followed by a manifest that `load` checks (see `_manifest`).

    The library is written in a temporary directory beside `path` by a forked child and renamed
    over `path` only once complete: a failed write (a full disk, where LLVM would end the whole
    process) is an OSError here, and an earlier export at `path` stays as it was.
    """
    if not isinstance(executable, relax.VMExecutable):
        raise TypeError(f"export: executable must be what tvm_ext.build returns (a relax.VMExecutable), "
                        f"got {type(executable).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"export: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path.endswith(".so"):
        raise ValueError(f"export path {path!r} must end in .so")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"directory {parent!r} for the exported model does not exist")
    manifest = _manifest(executable)
    workspace = None
    try:
        workspace = tempfile.mkdtemp(prefix=".tvm_ext_export.", dir=parent)
        tmp = os.path.join(workspace, os.path.basename(path))
        _write_library(executable, tmp)
        size = os.path.getsize(tmp)
        manifest.update(size=size, sha256=file_sha256(tmp, size))
        with open(tmp, "ab") as f:
            f.write(manifest_trailer(manifest))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # before the cleanup below: the free space is what the write found
        raise OSError(err.errno, f"could not export to {path!r}: {err.strerror or err} "
                                 f"({shutil.disk_usage(parent).free} bytes free in {parent!r})") from err
    finally:
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)
    return path


def _manifest(executable) -> dict:
    """What `load` checks before running an export: the device it runs on, the CUDA arch and the
    CPU flags (/proc/cpuinfo names) its code needs, with the target and versions for the message."""
    target = getattr(executable, "tvm_ext_target", None)
    llvm = _modules(executable.mod, "llvm")
    host = json.loads(llvm[0].get_function("_get_target_string")()) if llvm else {}
    cuda = bool(_modules(executable.mod, "cuda"))
    arch = str(target.attrs["arch"]) if cuda and target is not None and target.kind.name == "cuda" else None
    return {"format": 1, "device": "cuda" if cuda else "cpu", "cuda_arch": arch, "cpu_features": cpu_flags(host),
            "target": str(target) if target is not None else json.dumps(host), "tvm": tvm.__version__,
            "tvm_ext": __version__}


def _write_library(executable, tmp: str) -> None:
    """`executable.export_library(tmp)` in a forked child, its intermediate files (and the C
    compiler's: TMPDIR) beside `tmp`. LLVM ends the process on a write error ("LLVM ERROR: IO failure
    on output stream"); here only the child ends, and its failure is an OSError with what it said
    last (ENOSPC where the disk is full)."""
    workspace = os.path.dirname(tmp)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns to the caller's code
        status = 1
        try:
            os.close(read)
            os.dup2(write, 2)
            os.environ["TMPDIR"] = tempfile.tempdir = workspace
            executable.export_library(tmp, workspace_dir=workspace)
            status = 0
        except BaseException as err:  # noqa: BLE001 -- reported to the parent, which raises
            os.write(2, f"\n{type(err).__name__}: {err}\n".encode(errors="replace"))
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status == 0:
        sys.stderr.write(said)  # the writer's warnings, as they would have been printed
        return
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    why = lines[-1] if lines else f"the library writer ended with status {os.waitstatus_to_exitcode(status)}"
    full = "No space left" in said or shutil.disk_usage(workspace).free < MIN_FREE_BYTES
    raise OSError(errno.ENOSPC if full else errno.EIO, why)
