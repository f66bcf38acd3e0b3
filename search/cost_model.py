"""Cost model: XGBoost ranking candidates of a task by predicted speed.

`rank:pairwise` with each task a query group, so tasks of very different sizes train one model;
it also ranks tasks never measured (transfer). Saved beside the tuning logs in XGBoost's JSON."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import xgboost as xgb

from .features import SCHEMA

PARAMS = {"objective": "rank:pairwise", "eta": 0.2, "max_depth": 6, "min_child_weight": 1, "verbosity": 0,
          "nthread": 2}
ROUNDS = 60


class CostModel:
    """score(x) grows with predicted speed; untrained, it scores every candidate 0."""

    def __init__(self, booster: xgb.Booster | None = None):
        self.booster = booster

    def fit(self, groups: list[tuple[np.ndarray, np.ndarray]]) -> "CostModel":
        """groups: per task, (features [n, d], measured latency in us [n]); groups of one point teach nothing."""
        groups = [(x, us) for x, us in groups if len(us) > 1]
        if not groups:
            return self
        x = np.concatenate([g[0] for g in groups])
        # relevance: within a task, the faster the higher (ranks, so scales across tasks do not matter)
        relevance = np.concatenate([np.argsort(np.argsort(-us)).astype("float32") for _, us in groups])
        data = xgb.DMatrix(x, label=relevance)
        data.set_group([len(us) for _, us in groups])
        self.booster = xgb.train(PARAMS, data, num_boost_round=ROUNDS)
        return self

    def score(self, x: np.ndarray) -> np.ndarray:
        if self.booster is None or len(x) == 0:
            return np.zeros(len(x), dtype="float32")
        return self.booster.predict(xgb.DMatrix(x))

    def save(self, path: str | os.PathLike) -> None:
        if self.booster is None:
            raise ValueError("an untrained cost model has nothing to save")
        root, ext = os.path.splitext(os.fspath(path))
        # a name of this writer's own (two tuners sharing a log save beside each other), with the
        # extension XGBoost picks its format by; the rename is atomic, so a reader or a crash
        # mid-write sees the previous model whole
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(root) + ".", suffix=f".tmp{ext}",
                                   dir=os.path.dirname(os.path.abspath(root)))
        os.close(fd)
        try:
            self.booster.save_model(tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"cost model {os.fspath(path)!r} does not exist")
        booster = xgb.Booster()
        booster.load_model(os.fspath(path))
        return cls(booster)


COMMITTEE = 8  # members of a Committee


class Committee:
    """CostModels trained on the same groups, each with the rows of every group in another order;
    their scores averaged. One model's first pick for a task no group measured swings with the
    order of its training rows; the average of several does not (measured on the hidden shapes:
    docs/performance.md, "Transfer to unseen shapes")."""

    def __init__(self, size: int = COMMITTEE):
        self.size, self.members = size, []

    def fit(self, groups: list[tuple[np.ndarray, np.ndarray]]) -> "Committee":
        self.members = [m for k in range(self.size) if (m := CostModel().fit(_reordered(groups, k))).booster is not None]
        return self

    def score(self, x: np.ndarray) -> np.ndarray:
        return np.mean([m.score(x) for m in self.members], axis=0) if self.members else np.zeros(len(x), "float32")


def _reordered(groups: list, seed: int) -> list:
    """`groups` with each group's rows in the order of seed `seed` (0: as given)."""
    if not seed:
        return groups
    rng = np.random.default_rng(seed)
    return [(x[p], us[p]) for x, us in groups for p in [rng.permutation(len(us))]]


def trainable(rec: dict) -> bool:
    """Whether a log record is a training example: a successful measurement whose features have
    this feature schema."""
    return rec.get("error") is None and (rec.get("features") or {}).get("schema") == SCHEMA


def logged_groups(records, exclude: set = frozenset()) -> list[tuple[np.ndarray, np.ndarray]]:
    """Training groups (one per task key) from log records (the `trainable` ones); keys in
    `exclude` are left out (their search owns them)."""
    by_key: dict = {}
    for rec in records:
        if trainable(rec) and rec["key"] not in exclude:
            by_key.setdefault(rec["key"], []).append((rec["features"]["values"], rec["us"]))
    return [(np.asarray([f for f, _ in rows], dtype="float32"), np.asarray([us for _, us in rows]))
            for rows in by_key.values()]
