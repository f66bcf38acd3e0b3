"""The tuning-log format and its reader.

The pipeline reads logs, the tuner (`search/`) appends to them; both meet here so that a
deployment build never has to import the tuner. One JSON object per line:

    {"version": 1, "key": "<task key>", "task": "fused_layer_norm", "tvm": "0.27.0.post1",
     "knobs": {"strategy": "block_row", "threads": 256, ...}, "us": 31.2, "samples": [31.2, ...]}

A failed measurement has "us": null and an "error"; the reader passes over it (it is the tuner's).

A line that does not parse, or comes from another TVM version, is skipped with a warning:
it must never be misapplied, and it must never stop a build.
"""

from __future__ import annotations

import fcntl
import json
import os
import warnings
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

VERSION = 1


def task_key(func: tirx.PrimFunc, target: Target) -> str:
    """Stable identity of a fused PrimFunc on a target: structure (symbolic dims kept) + arch."""
    digest = tvm_ffi.structural_hash(func.without_attr("global_symbol"), map_free_vars=True)
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    return f"{digest & (2**64 - 1):016x}-{target.kind.name}{'-' + arch if arch else ''}"


@dataclass
class Database:
    """Best knobs per task key, read from one log file."""

    path: str
    best: dict = field(default_factory=dict)  # key -> (us, knobs)
    skipped: int = 0

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Database":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tuning log {path!r} does not exist")
        db = cls(path)
        with open(path, encoding="utf-8") as log:
            for number, line in enumerate(log, 1):
                if line.strip():
                    db._add(line, number)
        if db.skipped:
            warnings.warn(f"tvm_ext: skipped {db.skipped} unusable line(s) of tuning log {path}", stacklevel=2)
        return db

    def _add(self, line: str, number: int) -> None:
        try:
            rec = json.loads(line)
            if rec.get("error") is not None and rec.get("version") == VERSION:
                return  # a failed candidate: kept in the log for the tuner, never a best
            key, knobs, us = rec["key"], rec["knobs"], float(rec["us"])
            usable = rec.get("version") == VERSION and rec.get("tvm") == tvm.__version__ and isinstance(knobs, dict)
        except (ValueError, KeyError, TypeError):
            usable = False
        if not usable:
            self.skipped += 1
            return
        if key not in self.best or us < self.best[key][0]:
            self.best[key] = (us, knobs)

    def lookup(self, func: tirx.PrimFunc, target: Target) -> dict | None:
        entry = self.best.get(task_key(func, target))
        return dict(entry[1]) if entry else None


def append_record(path: str | os.PathLike, func: tirx.PrimFunc, target: Target, task: str, knobs: dict,
                  us: float | None, error: str | None = None, samples: list | None = None):
    """Append one measurement (its best latency, or the error that made it fail); a whole line per
    write under a lock, so tuners may share a log."""
    rec = {"version": VERSION, "key": task_key(func, target), "task": task, "tvm": tvm.__version__,
           "knobs": knobs, "us": None if us is None else float(us)}
    if error is not None:
        rec["error"] = error
    if samples:
        rec["samples"] = [float(t) for t in samples]
    with open(path, "a", encoding="utf-8") as log:
        fcntl.flock(log, fcntl.LOCK_EX)
        log.write(json.dumps(rec, sort_keys=True) + "\n")
        log.flush()
        fcntl.flock(log, fcntl.LOCK_UN)
