"""Search strategy: model-guided batches over a task's space, with early stopping.

Each round measures a batch: mostly the unmeasured points the cost model ranks highest, plus a few
random ones (epsilon) so that a wrong model still gets corrected; the model is retrained on every
successful measurement so far (warm-started from the log's other tasks when given). The search
stops after `trials`, or when `patience` rounds have not improved the best.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from tvm_ext.records import append_record

from .cost_model import CostModel
from .features import candidate_features
from .measure import Result, measure
from .space import knob_space
from .tasks import Task


@dataclass
class TaskResult:
    task: Task
    results: list = field(default_factory=list)  # every Result, in measurement order

    @property
    def best(self) -> Result | None:
        good = [r for r in self.results if r.error is None]
        return min(good, key=lambda r: r.best_us) if good else None


def tune_task(task: Task, target, trials: int, log: str, batch: int = 8, epsilon: float = 0.25,
              patience: int = 3, dims: dict | None = None, seed: int = 0, prior: list | None = None,
              timeout: float = 60.0, progress: bool = True) -> TaskResult:
    """Search `task`'s knobs with at most `trials` measurements, appending each to `log`.

    `prior`: (features, latencies) groups of other tasks, to train the model before this task has
    any measurement of its own.
    """
    points = knob_space(task.func, target)
    x = candidate_features(task.func, points, target)
    prior = list(prior or [])
    rng, out, model = random.Random(seed), TaskResult(task), CostModel().fit(prior)
    measured: list = []  # indices into points, in measurement order
    best, stale = float("inf"), 0
    budget = min(trials, len(points))
    bar = tqdm(total=budget, desc=task.name, disable=not progress, leave=False)
    while len(measured) < budget and stale < patience:
        left = [i for i in range(len(points)) if i not in measured]
        ranked = [left[j] for j in np.argsort(-model.score(x[left]), kind="stable")]
        size = min(batch, budget - len(measured))
        explore = min(size, max(1, round(size * epsilon))) if measured else 0  # the first batch trusts the model
        chosen = ranked[:size - explore]
        chosen += rng.sample([i for i in left if i not in chosen], explore)
        for i, result in zip(chosen, measure(task.func, target, [points[i] for i in chosen], dims, timeout)):
            measured.append(i)
            out.results.append(result)
            append_record(log, task.func, target, task.name, result.knobs,
                          None if result.error else result.best_us, result.error, result.us)
        bar.update(len(chosen))
        round_best = out.best.best_us if out.best else float("inf")
        stale = 0 if round_best < best else stale + 1
        best = min(best, round_best)
        good = [(i, r) for i, r in zip(measured, out.results) if r.error is None]
        own = (x[[i for i, _ in good]], np.array([r.best_us for _, r in good]))
        model = CostModel().fit(prior + [own])
    bar.close()
    return out
