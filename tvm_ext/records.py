"""The tuning-log format (JSON lines: task key, TVM version, target, knobs, latency) and its reader.

The pipeline reads logs, the tuner (`search/`) appends to them; both meet here so a deployment
build never imports the tuner. Failed measurements, unreadable lines, other TVM versions and knobs
that are no point of the function's space are skipped with a warning: a record is never misapplied
and never stops a build."""

from __future__ import annotations

import fcntl
import json
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

from tvm_ext.schedules.dispatch import knobs_problem

VERSION = 1


def target_name(target: Target) -> str:
    # sm_90a is sm_90 plus its arch-specific instructions (wgmma): one chip, one set of records
    arch = str(target.attrs.get("arch", "")).removesuffix("a") if target.kind.name == "cuda" else ""
    return f"{target.kind.name}{'-' + arch if arch else ''}"


def task_key(func: tirx.PrimFunc, target: Target) -> str:
    """Stable identity of a fused PrimFunc on a target: structure (symbolic dims kept) + arch."""
    digest = tvm_ffi.structural_hash(func.without_attr("global_symbol"), map_free_vars=True)
    return f"{digest & (2**64 - 1):016x}-{target_name(target)}"


SHOWN = 5  # skipped lines named in a warning (the rest are counted)


def record_problem(rec) -> str | None:
    """Why a parsed log line is not a usable record, or None when it is: a failed measurement has
    an error text, a successful one a finite positive latency (JSON also spells NaN, Infinity,
    true and strings)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("version") != VERSION or rec.get("tvm") != tvm.__version__:
        return f"written by version {rec.get('version')!r} under TVM {rec.get('tvm')!r}, not {VERSION} under {tvm.__version__}"
    if not isinstance(rec.get("key"), str):
        return "no task key"
    if not isinstance(rec.get("knobs"), dict):
        return f"knobs {rec.get('knobs')!r} are not a JSON object"
    error, us = rec.get("error"), rec.get("us")
    if error is not None:  # a failure, whatever latency it carries (timed, then found wrong)
        return None if isinstance(error, str) else f"error {error!r} is not a text"
    if type(us) not in (int, float) or not math.isfinite(us) or us <= 0:
        return f"latency {us!r} is not a finite positive number"
    return None


def numbered_records(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every usable record of a log, in order (failed measurements
    included: they carry "error"). Unusable lines are skipped, with one warning at the end naming
    the log and the first few lines with what is wrong with each."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"tuning log {path!r} is a directory, not a log file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tuning log {path!r} does not exist")
    skipped = []
    with open(path, "rb") as log:
        for number, raw in enumerate(log, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                skipped.append(f"line {number}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                skipped.append(f"line {number}: not JSON")
                continue
            problem = record_problem(rec)
            if problem is None:
                yield number, rec
            else:
                skipped.append(f"line {number}: {problem}")
    if skipped:
        more = f"; {len(skipped) - SHOWN} more" if len(skipped) > SHOWN else ""
        warnings.warn(f"tvm_ext: skipped {len(skipped)} unusable line(s) of tuning log {path}: "
                      f"{'; '.join(skipped[:SHOWN])}{more}", stacklevel=3)


def read_records(path: str | os.PathLike) -> Iterator[dict]:
    """Every usable record of a log, in order (see numbered_records)."""
    for _, rec in numbered_records(path):
        yield rec


@dataclass
class Database:
    """Best knobs per task key, read from one log file; counts the functions it is asked about and
    those that take a record."""

    path: str
    best: dict = field(default_factory=dict)  # key -> (us, knobs, line in the log) of its best record
    by_dims: dict = field(default_factory=dict)  # key -> {sorted (name, size) measured at: (us, knobs, line)}
    targets: set = field(default_factory=set)  # target_name of every record
    asked: set = field(default_factory=set)  # task keys looked up
    taken: set = field(default_factory=set)  # task keys whose record was applied
    foreign_warned: bool = False  # warn_if_foreign has said that nothing can match

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Database":
        return cls.from_records(path, numbered_records(path))

    @classmethod
    def from_records(cls, path: str | os.PathLike, records) -> "Database":
        """The best successful record per key of `records` ((line, record) pairs, or records
        alone, read from `path`), and per key and the symbolic sizes it was measured at."""
        db = cls(os.fspath(path))
        for line, rec in (r if isinstance(r, tuple) else (None, r) for r in records):
            db.targets.add(rec.get("target"))
            if rec.get("error") is not None:
                continue
            entry, at = (float(rec["us"]), rec["knobs"], line), tuple(sorted(rec.get("dims", {}).items()))
            for table, slot in ((db.best, rec["key"]), (db.by_dims.setdefault(rec["key"], {}), at)):
                if slot not in table or entry[0] < table[slot][0]:
                    table[slot] = entry
        return db

    def warn_if_foreign(self, target: Target) -> None:
        """One warning when the log holds records, none of them for `target` (their keys cannot
        match, so the heuristic schedules everything: say so rather than pretend it was tuned)."""
        if self.targets and target_name(target) not in self.targets:
            self.foreign_warned = True
            warnings.warn(f"tvm_ext: tuning log {self.path} has no records for target {target_name(target)} (it has "
                          f"{', '.join(sorted(map(str, self.targets)))}); using heuristic schedules", stacklevel=2)

    def lookup(self, func: tirx.PrimFunc, target: Target) -> dict | None:
        """The knobs of `func`'s best record, or None (the heuristic's turn) when it has none or
        they are no point of their strategy's space for `func` on `target` (with a warning)."""
        key = task_key(func, target)
        self.asked.add(key)
        usable = self._usable(func, target, [self.best[key]] if key in self.best else [])
        if usable:
            self.taken.add(key)
        return dict(usable[0]) if usable else None

    def lookup_classes(self, func: tirx.PrimFunc, target: Target) -> list[tuple[dict, dict]]:
        """[(symbolic sizes measured at, knobs)] of `func`'s best record at each, fastest first, less
        those whose knobs are no point of its space (with a warning): for kernels chosen per call
        by a symbolic size, where a record stands for the sizes it was measured at."""
        key = task_key(func, target)
        self.asked.add(key)
        entries = sorted(self.by_dims.get(key, {}).items(), key=lambda item: item[1][0])
        usable = self._usable(func, target, [entry for _, entry in entries])
        if usable:
            self.taken.add(key)
        return [(dict(at), dict(entry[1])) for at, entry in entries if entry[1] in usable]

    def _usable(self, func, target, entries: list) -> list[dict]:
        """The knobs of `entries` ((us, knobs, line)) that are points of their strategy's space for
        `func` on `target`; one warning for each that is not."""
        usable = []
        for _, knobs, line in entries:
            problem = knobs_problem(func, target, knobs)
            if problem:
                warnings.warn(f"tvm_ext: tuning log {self.path} line {line}: knobs {json.dumps(knobs, sort_keys=True)} "
                              f"{problem}; using the heuristic schedule", stacklevel=3)
            else:
                usable.append(knobs)
        return usable

    def latency(self, func: tirx.PrimFunc, target: Target) -> float | None:
        """The best logged latency of `func` on `target` in us, or None when it has no record."""
        best = self.best.get(task_key(func, target))
        return None if best is None else best[0]

    def warn_if_unmatched(self) -> None:
        """One warning when no task looked up took a record (and warn_if_foreign did not already
        say why): the log was tuned for another model or shape."""
        if not self.taken and not self.foreign_warned:
            warnings.warn(f"tvm_ext: tuning log {self.path} has a usable record for none of the {len(self.asked)} "
                          f"task(s) of this build (it holds {len(self.best)}); using heuristic schedules", stacklevel=3)


def utc_now() -> str:
    """A record's time: ISO 8601 UTC to the millisecond (throughput is read from records' times)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def append_record(path: str | os.PathLike, func: tirx.PrimFunc, target: Target, task: str, knobs: dict,
                  us: float | None, error: str | None = None, samples: list | None = None,
                  features: dict | None = None, dims: dict | None = None):
    """Append one measurement (its best latency, or the error that made it fail); `dims`: the
    sizes of `func`'s symbolic dims it was measured at (none: NOMINAL).

    One whole line per write under an exclusive lock, so tuners may share a log; a torn last line
    (a writer killed mid-line) is closed first, so it stays one skipped line and never swallows this one.
    """
    rec = {"version": VERSION, "key": task_key(func, target), "task": task, "tvm": tvm.__version__,
           "target": target_name(target), "time": utc_now(),
           "knobs": knobs, "us": None if us is None else float(us)}
    if error is not None:
        rec["error"] = error
    if samples:
        rec["samples"] = [float(t) for t in samples]
    if features is not None:
        rec["features"] = features
    if dims:
        rec["dims"] = {name: int(size) for name, size in dims.items()}
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
