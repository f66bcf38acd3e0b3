"""Transfer: schedules for tasks the log has never measured, chosen by its cost model (0 trials).

`ModelDatabase` answers `lookup` like a plain log: the logged best where measured, else the cost
model's first pick among the task's points of templates it was trained on (none: the heuristic's),
so the build never needs the tuner."""

from __future__ import annotations

import os

import numpy as np
from tvm import tirx
from tvm.target import Target

from tvm_ext.records import Database, numbered_records

from .cost_model import Committee, CostModel, logged_groups, trainable
from .features import candidate_features
from .space import knob_space


class ModelDatabase(Database):
    """Tuning logs plus a committee of cost models trained on all of them (the shipped logs of
    tuning_logs/ pick schedules for shapes none of them measured)."""

    model: Committee
    strategies: frozenset  # the templates of its training records: it ranks only their points

    @classmethod
    def load(cls, paths: str | os.PathLike | list) -> "ModelDatabase":
        """The records of one log, or of each log in a list (a line named by its log's file)."""
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        records = [(f"{os.path.basename(p)}:{n}" if len(paths) > 1 else n, rec)  # read once: a bad line warns once
                   for p in paths for n, rec in numbered_records(p)]
        label = ", ".join(map(os.fspath, paths))
        db = cls.from_records(label, records)
        db.model = Committee().fit(logged_groups([rec for _, rec in records]))
        db.strategies = frozenset(rec["knobs"].get("strategy") for _, rec in records if trainable(rec))
        if not db.model.members:
            raise ValueError(f"tuning log(s) {label!r} have too few measurements to train a cost model")
        return db

    def lookup(self, func: tirx.PrimFunc, target: Target) -> dict | None:
        return super().lookup(func, target) or predict(self.model, func, target, self.strategies)


def predict(model: CostModel | Committee, func: tirx.PrimFunc, target: Target, strategies=None) -> dict | None:
    """The point of `func`'s space `model` ranks first, among those of `strategies` where given
    (None when no such point is in the space)."""
    points = [p for p in knob_space(func, target) if strategies is None or p["strategy"] in strategies]
    if not points:
        return None
    return dict(points[int(np.argmax(model.score(candidate_features(func, points, target))))])
