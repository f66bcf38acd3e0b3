"""The XGBoost cost model ranks held-out candidates and a never-measured task, and round-trips a file."""

import numpy as np
import pytest

from tvm_ext.search.cost_model import CostModel


def synthetic_task(rng, n=60, scale=1.0):
    """Latency that depends on two of five features (a bowl around 0.3 plus a slope), times a task scale."""
    x = rng.random((n, 5)).astype("float32")
    us = scale * (10 + 50 * (x[:, 0] - 0.3) ** 2 + 5 * x[:, 3]) + rng.normal(0, 0.1 * scale, n)
    return x, us


def rank_correlation(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_ranks_held_out_points_and_an_unseen_task(rng):
    train = [synthetic_task(rng, scale=s) for s in (1.0, 7.0, 40.0)]  # very different sizes
    model = CostModel().fit(train)
    for x, us in (synthetic_task(rng), synthetic_task(rng, scale=1000.0)):  # held out; a task never seen
        assert rank_correlation(model.score(x), -us) > 0.7  # higher score, lower latency


def test_untrained_scores_zero_and_single_points_teach_nothing(rng):
    x, us = synthetic_task(rng, n=1)
    model = CostModel().fit([(x, us)])
    assert model.booster is None and (model.score(synthetic_task(rng)[0]) == 0).all()


def test_save_and_load_give_the_same_scores(tmp_path, rng):
    model = CostModel().fit([synthetic_task(rng), synthetic_task(rng, scale=3.0)])
    model.save(tmp_path / "model.json")
    x = synthetic_task(rng)[0]
    np.testing.assert_array_equal(CostModel.load(tmp_path / "model.json").score(x), model.score(x))
    with pytest.raises(FileNotFoundError, match="cost model .*missing.json"):
        CostModel.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="untrained"):
        CostModel().save(tmp_path / "empty.json")


def test_concurrent_saves_to_one_path_all_succeed_and_leave_one_whole_model(tmp_path, rng):
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    model = CostModel().fit([synthetic_task(rng), synthetic_task(rng, scale=3.0)])
    path = tmp_path / "shared.model.json"  # two tuners sharing a log save their models here
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: model.save(path), range(200)))  # a failed save raises here
    x = synthetic_task(rng)[0]
    np.testing.assert_array_equal(CostModel.load(path).score(x), model.score(x))
    assert [p.name for p in tmp_path.iterdir()] == ["shared.model.json"]  # no temporary file left behind


def test_a_committee_averages_members_trained_on_reordered_rows(rng):
    """Each member sees every group's rows in another order (the first as given); the committee's
    score is their mean, and it ranks an unseen task like one model does."""
    from tvm_ext.search.cost_model import Committee, _reordered  # noqa: PLC0415

    train = [synthetic_task(rng, scale=s) for s in (1.0, 7.0, 40.0)]
    assert _reordered(train, 0) is train
    moved = _reordered(train, 3)
    for (x, us), (mx, mus) in zip(train, moved):
        assert not np.array_equal(mx, x)  # another order of the same rows
        assert sorted(map(tuple, mx.tolist())) == sorted(map(tuple, x.tolist())) and sorted(mus) == sorted(us)
        assert {tuple(r) + (u,) for r, u in zip(mx.tolist(), mus)} == {tuple(r) + (u,) for r, u in zip(x.tolist(), us)}
    committee = Committee(4).fit(train)
    x, us = synthetic_task(rng, scale=1000.0)
    assert len(committee.members) == 4
    np.testing.assert_allclose(committee.score(x), np.mean([m.score(x) for m in committee.members], axis=0), rtol=1e-6)
    assert rank_correlation(committee.score(x), -us) > 0.7
    assert not Committee().fit([]).members and not Committee().score(x).any()  # untrained: scores 0
