"""Transfer: schedules for tasks the log has never measured, chosen by its cost model (0 trials).

`ModelDatabase` answers `lookup` like a plain log: the logged best where measured, else the cost
model's first pick from the task's space, so the build never needs the tuner."""

from __future__ import annotations

import os

import numpy as np
from tvm import tirx
from tvm.target import Target

from tvm_ext.records import Database, read_records

from .cost_model import CostModel, logged_groups
from .features import candidate_features
from .space import knob_space


class ModelDatabase(Database):
    """A tuning log plus its cost model."""

    model: CostModel

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelDatabase":
        records = list(read_records(path))  # read once: a bad line warns once
        db = cls.from_records(path, records)
        db.model = CostModel().fit(logged_groups(records))
        if db.model.booster is None:
            raise ValueError(f"tuning log {os.fspath(path)!r} has too few measurements to train a cost model")
        return db

    def lookup(self, func: tirx.PrimFunc, target: Target) -> dict | None:
        return super().lookup(func, target) or predict(self.model, func, target)


def predict(model: CostModel, func: tirx.PrimFunc, target: Target) -> dict | None:
    """The point of `func`'s space `model` ranks first (None when no template fits it)."""
    points = knob_space(func, target)
    if not points:
        return None
    return dict(points[int(np.argmax(model.score(candidate_features(func, points, target))))])
