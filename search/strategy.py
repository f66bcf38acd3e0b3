"""Search strategy: model-guided batches over one task's space, with early stopping.

First batch: the heuristic's point plus the model's guesses (or random points). Later batches: the
model's top unmeasured points plus a few random ones, retraining after each. Stops at the budget,
an exhausted space, or `patience` batches without improvement."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from tvm_ext.records import append_record

from .check import measured_dims
from .cost_model import CostModel
from .features import SCHEMA, candidate_features
from .measure import Result
from .worker_pool import WORKER_DID_NOT_START
from .space import space_and_heuristic
from .tasks import Task


class TaskSearch:
    """The search state of one task: its space, what has been measured, its cost model."""

    def __init__(self, task: Task, target, log: str, budget: int, dims: dict | None = None, past=(),
                 batch: int = 8, epsilon: float = 0.25, patience: int = 3, seed: int = 0):
        """`past`: this task's records already in the log (a resumed run): they count as trials."""
        self.task, self.target, self.log, self.dims = task, target, log, dims or {}
        self.batch, self.epsilon, self.patience = batch, epsilon, patience
        self.points, self.heuristic = space_and_heuristic(task.func, target, self.dims)  # the points hold it
        self.at = measured_dims(task.func, self.dims)  # the symbolic sizes its records are measured at
        self.x = candidate_features(task.func, self.points, target, self.dims)
        self.budget = min(budget, len(self.points))
        self.rng, self.model = random.Random(seed), CostModel()
        self.measured: list = []  # indices into points, in measurement order
        self.results: list = []  # their Results
        self.stale, self.batches = 0, 0
        self.improvement = 0.0  # relative gain of the last batch
        for rec in past:
            if (rec.get("error") or "").startswith(WORKER_DID_NOT_START):
                continue  # the machinery failed, not the candidate: measure it again
            if measured_dims(task.func, rec.get("dims")) != self.at:
                continue  # measured at other symbolic sizes
            i = self.points.index(rec["knobs"]) if rec["knobs"] in self.points else None
            if i is not None and i not in self.measured:
                self.measured.append(i)
                self.results.append(Result(rec["knobs"], rec.get("samples") or ([rec["us"]] if rec["us"] else []),
                                           rec.get("error")))

    @property
    def best(self) -> Result | None:
        good = [r for r in self.results if r.error is None]
        return min(good, key=lambda r: r.best_us) if good else None

    @property
    def best_us(self) -> float:
        return self.best.best_us if self.best else float("inf")

    @property
    def heuristic_result(self) -> Result | None:
        return next((r for r in self.results if r.knobs == self.heuristic), None)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why this task takes no more trials ("space exhausted", ...), None while it goes on."""
        if len(self.measured) >= len(self.points):
            return "space exhausted"
        if len(self.measured) >= self.budget:
            return "budget spent"
        if self.stale >= self.patience:
            return f"no gain in {self.patience} batches"
        return None

    def _record(self, i: int, result) -> None:
        """Point i's result, kept and appended to the log."""
        self.measured.append(i)
        self.results.append(result)
        append_record(self.log, self.task.func, self.target, self.task.name, result.knobs,
                      None if result.error else result.best_us, result.error, result.us,
                      {"schema": SCHEMA, "values": [float(v) for v in self.x[i]]}, self.at)

    def curve(self) -> list[float]:
        """Best latency so far after each trial (inf until one succeeds)."""
        return list(np.minimum.accumulate([r.best_us for r in self.results])) if self.results else []

    def own_group(self) -> tuple[np.ndarray, np.ndarray]:
        good = [(i, r) for i, r in zip(self.measured, self.results) if r.error is None]
        return self.x[[i for i, _ in good]], np.array([r.best_us for _, r in good])

    def retrain(self, groups: list) -> None:
        """Fit the model on `groups` (other tasks' measurements: transfer) and this task's own."""
        self.model = CostModel().fit(list(groups) + [self.own_group()])

    def next_batch(self, limit: int) -> list[int]:
        left = [i for i in range(len(self.points)) if i not in self.measured]
        size = min(self.batch, self.budget - len(self.measured), limit, len(left))
        chosen = []
        if not self.measured and self.heuristic is not None and self.points.index(self.heuristic) in left:
            chosen.append(self.points.index(self.heuristic))  # the default is always a baseline
        if self.epsilon >= 1 or self.model.booster is None:  # random search, or nothing to rank by yet
            explore = size
        else:
            explore = min(size, max(1, round(size * self.epsilon))) if self.measured else 0
        ranked = [left[j] for j in np.argsort(-self.model.score(self.x[left]), kind="stable")]
        chosen += [i for i in ranked if i not in chosen][:max(0, size - explore - len(chosen))]
        chosen += self.rng.sample([i for i in left if i not in chosen], size - len(chosen))
        return chosen

    def propose(self, limit: int) -> "Batch":
        """The next batch of at most `limit` points, to be measured (Batch.on_result as each
        finishes) and closed with its Results."""
        return Batch(self, self.next_batch(limit), self.best_us)


@dataclass
class Batch:
    """One batch of a task's points in measurement: each logged as soon as it finishes
    (`on_result(j, result)` for the j-th), so that an interrupted batch keeps its finished
    measurements; `close` logs any not reported that way and updates the search."""
    search: TaskSearch
    chosen: list  # indices into the search's points
    before: float  # the search's best latency before this batch
    logged: set = field(default_factory=set)

    @property
    def candidates(self) -> list[dict]:
        return [self.search.points[i] for i in self.chosen]

    def on_result(self, j: int, result) -> None:
        if j not in self.logged:
            self.logged.add(j)
            self.search._record(self.chosen[j], result)

    def close(self, results) -> int:
        """Record `results` (one per candidate); the number of candidates measured."""
        for j, result in enumerate(results):
            self.on_result(j, result)
        search = self.search
        search.batches += 1
        improved = search.best_us < self.before
        search.stale = 0 if improved else search.stale + 1
        search.improvement = (self.before - search.best_us) / self.before if improved and self.before != float("inf") else 0.0
        return len(self.chosen)
