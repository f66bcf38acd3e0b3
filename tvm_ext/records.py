"""The tuning-log format and its reader.

The pipeline reads logs, the tuner (`search/`) appends to them; both meet here so that a
deployment build never has to import the tuner. One JSON object per line:

    {"version": 1, "key": "<task key>", "task": "fused_layer_norm", "tvm": "0.27.0.post1",
     "target": "cuda-sm_90", "time": "2026-11-21T10:00:00Z",
     "knobs": {"strategy": "block_row", "threads": 256, ...}, "us": 31.2, "samples": [31.2, ...],
     "features": {"schema": "<names digest>", "values": [...]}}

A failed measurement has "us": null and an "error"; the reader passes over it (it is the tuner's).
"features" is what the tuner's cost model saw (so a later run trains on the log without the
models that produced it); the pipeline ignores it.

A line that does not parse, or comes from another TVM version, is skipped with a warning:
it must never be misapplied, and it must never stop a build.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

VERSION = 1


def target_name(target: Target) -> str:
    # sm_90a is sm_90 plus its arch-specific instructions (wgmma): one chip, one set of records
    arch = str(target.attrs.get("arch", "")).removesuffix("a") if target.kind.name == "cuda" else ""
    return f"{target.kind.name}{'-' + arch if arch else ''}"


def task_key(func: tirx.PrimFunc, target: Target) -> str:
    """Stable identity of a fused PrimFunc on a target: structure (symbolic dims kept) + arch."""
    digest = tvm_ffi.structural_hash(func.without_attr("global_symbol"), map_free_vars=True)
    return f"{digest & (2**64 - 1):016x}-{target_name(target)}"


def _usable(rec) -> bool:
    return (isinstance(rec, dict) and rec.get("version") == VERSION and rec.get("tvm") == tvm.__version__
            and isinstance(rec.get("key"), str) and isinstance(rec.get("knobs"), dict)
            and (rec.get("error") is not None or isinstance(rec.get("us"), (int, float))))


def read_records(path: str | os.PathLike) -> Iterator[dict]:
    """Every usable record of a log, in order (failed measurements included: they carry "error").

    Lines that do not parse or that another version wrote are skipped, with one warning at the end.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tuning log {path!r} does not exist")
    skipped = 0
    with open(path, encoding="utf-8") as log:
        for line in log:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if _usable(rec):
                yield rec
            else:
                skipped += 1
    if skipped:
        warnings.warn(f"tvm_ext: skipped {skipped} unusable line(s) of tuning log {path}", stacklevel=2)


@dataclass
class Database:
    """Best knobs per task key, read from one log file."""

    path: str
    best: dict = field(default_factory=dict)  # key -> (us, knobs)
    targets: set = field(default_factory=set)  # target_name of every record

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Database":
        return cls.from_records(path, read_records(path))

    @classmethod
    def from_records(cls, path: str | os.PathLike, records) -> "Database":
        """The best successful record per key of `records` (read from `path`)."""
        db = cls(os.fspath(path))
        for rec in records:
            db.targets.add(rec.get("target"))
            if rec.get("error") is None and (rec["key"] not in db.best or rec["us"] < db.best[rec["key"]][0]):
                db.best[rec["key"]] = (float(rec["us"]), rec["knobs"])
        return db

    def warn_if_foreign(self, target: Target) -> None:
        """One warning when the log holds records, none of them for `target` (their keys cannot
        match, so the heuristic schedules everything: say so rather than pretend it was tuned)."""
        if self.targets and target_name(target) not in self.targets:
            warnings.warn(f"tvm_ext: tuning log {self.path} has no records for target {target_name(target)} (it has "
                          f"{', '.join(sorted(map(str, self.targets)))}); using heuristic schedules", stacklevel=2)

    def lookup(self, func: tirx.PrimFunc, target: Target) -> dict | None:
        entry = self.best.get(task_key(func, target))
        return dict(entry[1]) if entry else None


def append_record(path: str | os.PathLike, func: tirx.PrimFunc, target: Target, task: str, knobs: dict,
                  us: float | None, error: str | None = None, samples: list | None = None,
                  features: dict | None = None):
    """Append one measurement (its best latency, or the error that made it fail).

    One whole line per write under an exclusive lock, so tuners may share a log; a torn last line
    (a writer killed mid-line) is closed first, so it stays one skipped line and never swallows this one.
    """
    rec = {"version": VERSION, "key": task_key(func, target), "task": task, "tvm": tvm.__version__,
           "target": target_name(target), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "knobs": knobs, "us": None if us is None else float(us)}
    if error is not None:
        rec["error"] = error
    if samples:
        rec["samples"] = [float(t) for t in samples]
    if features is not None:
        rec["features"] = features
    line = json.dumps(rec, sort_keys=True) + "\n"
    with open(path, "a+b") as log:  # writes always append; reads see the last byte
        fcntl.flock(log, fcntl.LOCK_EX)
        try:
            end = log.seek(0, os.SEEK_END)
            if end:
                log.seek(end - 1)
                line = ("" if log.read(1) == b"\n" else "\n") + line
            log.write(line.encode("utf-8"))
            log.flush()
        finally:
            fcntl.flock(log, fcntl.LOCK_UN)
