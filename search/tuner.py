"""A tuning run: a model's tasks, searched under one budget, every measurement in one log.

Tasks -> searches warm-started from logged records -> the task scheduler spending trials through
worker processes. A log is only appended to, and only when resuming; the cost model is retrained
on the whole log at the end and saved beside it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tvm_ext.records import read_records
from tvm_ext.target import parse_target

from .cost_model import CostModel, logged_groups
from .check import measured, symbolic_names, task_bytes, task_flops
from .measure import Measurer
from .scheduler import tune
from .strategy import TaskSearch
from .tasks import extract_tasks

logger = logging.getLogger(__name__)


def model_path(log: str) -> str:
    """Where a log's cost model is saved: NAME.model.json beside NAME.json."""
    return os.path.splitext(log)[0] + ".model.json"


@dataclass
class TaskReport:
    name: str
    weight: int
    trials: int
    best_us: float
    heuristic_us: float | None
    gbps: float
    copy_fraction: float
    knobs: dict | None
    tflops: float = 0.0  # of the best candidate, for tasks with tensor-core work (check.task_flops)
    sizes: dict = field(default_factory=dict)  # the symbolic dims' sizes it was measured at

    @property
    def speedup(self) -> float | None:
        return self.heuristic_us / self.best_us if self.heuristic_us else None


def check_log(log: str, resume: bool) -> None:
    """Refuse, with one line naming it, a log that this run could not append to (a directory, an
    unwritable file or folder), one to resume that does not exist, or one not to resume that does:
    before any work, so that no measurement is lost to a log that cannot take it."""
    if os.path.isdir(log):
        raise IsADirectoryError(f"tuning log {log!r} is a directory: name a log file")
    if resume:
        if not os.path.isfile(log):
            raise FileNotFoundError(f"cannot resume: tuning log {log!r} does not exist")
        try:
            open(log, "ab").close()  # appends nothing: only asks for write access
        except OSError as err:
            raise PermissionError(f"tuning log {log!r} is not writable ({err.strerror})") from None
        return
    if os.path.exists(log):
        raise FileExistsError(f"tuning log {log!r} already exists: resume it (--resume) or name a new log")
    folder = os.path.dirname(os.path.abspath(log))
    while not os.path.exists(folder):  # the nearest existing folder is where the log's folders would be made
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"tuning log {log!r} cannot be created: {folder!r} is not a writable folder")


def _open_log(log: str, resume: bool) -> list[dict]:
    """The log's records (resumed), or a new empty log (a run stopped before its first record can
    still be resumed); check_log has passed it."""
    if resume:
        return list(read_records(log))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        open(log, "a", encoding="utf-8").close()
    except OSError as err:
        raise PermissionError(f"tuning log {log!r} cannot be created ({err.strerror})") from None
    return []


def tune_model(mod, target, trials: int, log: str, resume: bool = False, warm_start=(), dims=None,
               builders: int | None = None, timeout: float = 60.0, batch: int = 8, patience: int = 3,
               seed: int = 0, progress: bool = True, variance: str = "welford",
               rpc: tuple[str, str] | None = None) -> list[TaskReport]:
    """Tune every task of `mod` (or of a list of modules) with at most `trials` measurements in all.

    `variance`: the build option the log is for; "tuned" tunes the statistics of each variant
    (Welford and two-pass), so that a build with `variance="tuned"` takes the faster. `rpc`:
    (tracker HOST:PORT, key) to measure on the servers of TVM's RPC tracker (search/rpc.py)."""
    if trials < 0:
        raise ValueError(f"trials must be >= 0, not {trials}")
    check_log(log, resume)
    target = parse_target(target)
    tasks = extract_tasks(mod, target, variance=variance)
    if not tasks:
        raise ValueError("the model has no fused reduce subgraph for tvm_ext to tune (rows of a symbolic width are "
                         "not tuned: their width classes are chosen per call)")
    names = set().union(*(symbolic_names(task.func) for task in tasks))
    unknown = sorted(set(dims or {}) - names)
    if unknown:
        raise ValueError(f"dims {', '.join(unknown)} name no symbolic dim of the model's tasks; theirs: "
                         f"{', '.join(sorted(names)) or 'none'}")
    logged = _open_log(log, resume)
    keys = {task.key for task in tasks}
    others = [rec for path in warm_start for rec in read_records(path)]
    prior = logged_groups(logged + others, exclude=keys)
    searches = [TaskSearch(task, target, log, trials, dims, [r for r in logged if r["key"] == task.key],
                           batch=batch, patience=patience, seed=seed) for task in tasks]
    spent = sum(len(s.measured) for s in searches)
    with Measurer(target, builders=builders, timeout=timeout, rpc=rpc) as measurer:
        tune(searches, measurer, max(0, trials - spent), prior, progress, runners=measurer.runners.size)
        copy = measurer.copy_gbps()
        logger.info("measurement: %.1f s, of which the runner checked and timed for %.1f s",
                    measurer.seconds["measure"], measurer.seconds["run"])
    if os.path.getsize(log):
        model = CostModel().fit(logged_groups(read_records(log)))
        if model.booster is not None:
            model.save(model_path(log))
    return [_report(s, dims, copy) for s in searches]


def _report(search: TaskSearch, dims, copy_gbps: float) -> TaskReport:
    best, heuristic = search.best, search.heuristic_result
    func = measured(search.task.func, dims)
    gbps = task_bytes(func, dims) / best.best_us / 1e3 if best else 0.0
    return TaskReport(search.task.name, search.task.weight, len(search.measured),
                      best.best_us if best else float("inf"),
                      heuristic.best_us if heuristic and heuristic.error is None else None,
                      gbps, gbps / copy_gbps, best.knobs if best else None,
                      task_flops(func, dims) / best.best_us / 1e6 if best else 0.0, search.at)
