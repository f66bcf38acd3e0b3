"""Strategy and task scheduler against a known latency table (an oracle stands in for the GPU)."""

import json
import zlib

import numpy as np

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from tvm_ext.search.features import NAMES
from tvm_ext.search.measure import Result
from tvm_ext.search.scheduler import each_batch, tune
from tvm_ext.search.strategy import TaskSearch
from tvm_ext.search.tasks import Task, extract_tasks

TARGET = tvm_ext.parse_target(CUDA_TARGET)
COL = {name: i for i, name in enumerate(NAMES)}


def task(op, shape, weight=1):
    (t,) = extract_tasks(relax_module(op, shape, "float16"), TARGET)
    return Task(t.name, t.key, t.func, weight)


def oracle(search_by_func):
    """Latency as a smooth function of the features (what a model can learn) plus fixed per-point noise."""
    def measure(func, candidates, dims, on_result=None):
        search = search_by_func[func]
        out = []
        for knobs in candidates:
            x = search.x[search.points.index(knobs)]
            noise = zlib.crc32(repr(sorted(knobs.items())).encode()) % 100 / 2000
            us = 10 * (1 + (x[COL["log2_bytes_per_thread"]] - 5) ** 2 / 8 + 2 / (1 + x[COL["vector_bytes"]]) + noise)
            out.append(Result(knobs, [float(us)]))
        return out
    return measure


def exhaustive_best(search):
    return min(r.best_us for r in oracle({search.task.func: search})(search.task.func, search.points, {}))


def test_model_guided_search_beats_random_search_on_the_same_budget(tmp_path):
    t = task("layer_norm", [49152, 1024])
    found = {}
    for name, epsilon in (("model", 0.25), ("random", 1.0)):
        bests = []
        for seed in range(3):
            s = TaskSearch(t, TARGET, str(tmp_path / f"{name}{seed}.json"), budget=24, batch=8, epsilon=epsilon,
                           patience=99, seed=seed)
            tune([s], each_batch(oracle({t.func: s})), trials=24, progress=False)
            assert len(s.measured) == 24 and len(set(s.measured)) == 24
            bests.append(s.best_us)
        found[name] = bests
    optimum = exhaustive_best(s)
    assert len(s.points) == 264  # warp_row and block_row points, shared or register stages among them
    assert np.mean(found["model"]) < np.mean(found["random"]), found
    assert sum(b <= optimum * 1.03 for b in found["model"]) >= 2, (found, optimum)  # most seeds: within 3%


def test_budget_goes_to_the_heavier_task_and_every_task_gets_a_first_batch(tmp_path):
    heavy, light = task("layer_norm", [32768, 768], weight=12), task("softmax", [49152, 1024], weight=1)
    log = str(tmp_path / "two.json")
    searches = [TaskSearch(t, TARGET, log, budget=64, batch=4, patience=99) for t in (light, heavy)]
    tune(searches, each_batch(oracle({s.task.func: s for s in searches})), trials=40, progress=False)
    spent = {s.task.name: len(s.measured) for s in searches}
    assert sum(spent.values()) == 40 and min(spent.values()) >= 4
    assert spent["layer_norm"] > 2 * spent["softmax"], spent
    assert all(s.heuristic_result is not None for s in searches)  # each first batch measured the default
    assert len(open(log).read().splitlines()) == 40


def test_patience_stops_a_task_that_no_longer_improves(tmp_path):
    t = task("softmax", [8192, 4096])
    s = TaskSearch(t, TARGET, str(tmp_path / "flat.json"), budget=40, batch=4, patience=2)

    def flat(func, candidates, dims, on_result=None):
        return [Result(k, [10.0]) for k in candidates]

    tune([s], each_batch(flat), trials=40, progress=False)
    assert len(s.measured) == 12 and s.done  # one batch sets the best, two more that do not improve end it
    assert s.stop_reason == "no gain in 2 batches"


def test_a_run_that_exhausts_the_space_says_so_on_its_progress_bar(tmp_path, capsys):
    t = task("softmax", [8192, 4096])
    s = TaskSearch(t, TARGET, str(tmp_path / "all.json"), budget=1000, batch=8, patience=99)
    tune([s], each_batch(oracle({t.func: s})), trials=1000, progress=True)
    assert len(s.measured) == len(s.points) < 1000 and s.stop_reason == "space exhausted"
    final = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any("all tasks: 100%" in line and f"stopped at {len(s.points)} of 1000 trials: space exhausted" in line
               for line in final), final[-3:]


def test_a_resumed_run_measures_a_task_it_never_reached_before_the_others_again(tmp_path):
    """A run stopped before its last task: the resumed run's first batch goes to that task, though the
    heavier one would have the larger expected gain."""
    heavy, light = task("layer_norm", [8192, 4096], weight=8), task("softmax", [4096, 1024])
    log = str(tmp_path / "log.json")
    first = TaskSearch(heavy, TARGET, log, budget=64, batch=8)
    tune([first], each_batch(oracle({heavy.func: first})), trials=8, progress=False)
    past = [json.loads(line) for line in open(log, encoding="utf-8")]
    searches = [TaskSearch(t, TARGET, log, budget=64, batch=8, past=[r for r in past if r["key"] == t.key])
                for t in (heavy, light)]
    tune(searches, each_batch(oracle({s.task.func: s for s in searches})), trials=8, progress=False)
    assert [len(s.measured) for s in searches] == [8, 8]


def test_tasks_of_like_gain_share_a_round_and_a_heavy_one_takes_rounds_alone(tmp_path):
    """Rounds hold several tasks' batches (the measurer builds and runs them together): the five
    fresh tasks share the first round; later rounds hold the tasks within PEERS of the best
    expected gain, so a task twelve times heavier takes rounds of its own."""
    light = [task("softmax", [4096, n]) for n in (512, 1024, 2048, 4096)]
    heavy = task("layer_norm", [32768, 768], weight=12)
    log = str(tmp_path / "rounds.json")
    searches = [TaskSearch(t, TARGET, log, budget=64, batch=4, patience=99) for t in light + [heavy]]
    rounds = []
    measure_one = each_batch(oracle({s.task.func: s for s in searches}))

    def measure(batches):
        rounds.append([func for func, *_ in batches])
        return measure_one(batches)

    tune(searches, measure, trials=60, progress=False)
    assert len(rounds[0]) == 5  # every task fresh: 20 candidates in one round
    assert any(rounds[i] == [heavy.func] for i in range(1, len(rounds)))
    assert sum(len(s.measured) for s in searches) == 60


def test_a_round_takes_round_candidates_for_each_runner_and_finished_tasks_are_not_retrained(tmp_path):
    """Two RPC servers measure twice as many candidates a round (what a round costs besides its
    runs is then shared by twice as many); a task whose space is exhausted is not retrained."""
    tasks = [task("softmax", [4096, n]) for n in (256, 512, 1024, 2048, 4096, 8192)]
    sizes = {}
    for runners in (1, 2):
        log = str(tmp_path / f"runners{runners}.json")
        searches = [TaskSearch(t, TARGET, log, budget=64, batch=8, patience=99) for t in tasks]
        measure_one, rounds = each_batch(oracle({s.task.func: s for s in searches})), []

        def measure(batches):
            rounds.append(sum(len(candidates) for _, candidates, *_ in batches))
            return measure_one(batches)

        tune(searches, measure, trials=96, progress=False, runners=runners)
        sizes[runners] = rounds[0]
    assert sizes == {1: 24, 2: 48}

    (small,) = [TaskSearch(task("softmax", [4096, 64]), TARGET, str(tmp_path / "small.json"), budget=200, batch=200)]
    fits = []
    small.retrain = lambda groups: fits.append(len(groups))
    tune([small], each_batch(oracle({small.task.func: small})), trials=200, progress=False)
    assert small.done and len(fits) == 1  # the fit before its only batch, none after it exhausted its space


def test_batches_stream_a_task_goes_again_as_soon_as_its_batch_ends(tmp_path):
    """With a streaming measurer (submit/poll, as Measurer) the scheduler keeps ROUND candidates a
    runner in flight and submits a task's next batch when its last one ends, while the others are
    still in flight; a task never has two batches in flight."""
    from tvm_ext.search.scheduler import ROUND  # noqa: PLC0415

    tasks = [task("softmax", [4096, n]) for n in (256, 512, 1024, 2048, 4096, 8192)]
    searches = [TaskSearch(t, TARGET, str(tmp_path / "stream.json"), budget=64, batch=8, patience=99) for t in tasks]
    measure_one = oracle({s.task.func: s for s in searches})

    class Streaming:
        """Ends one batch a poll, the oldest first."""
        def __init__(self):
            self.flying, self.tokens, self.peak, self.events = {}, 0, 0, []

        def submit(self, func, candidates, dims=None, on_result=None):
            assert func not in [f for f, _ in self.flying.values()], "two batches of one task in flight"
            self.tokens += 1
            self.flying[self.tokens] = (func, candidates)
            self.peak = max(self.peak, sum(len(c) for _, c in self.flying.values()))
            self.events.append(("submit", func))
            return self.tokens

        def poll(self):
            token = min(self.flying)
            func, candidates = self.flying.pop(token)
            self.events.append(("end", func))
            return [(token, measure_one(func, candidates, {}))]

    streaming = Streaming()
    tune(searches, streaming, trials=96, progress=False)
    assert sum(len(s.measured) for s in searches) == 96
    assert streaming.peak == ROUND  # three batches of 8 in flight, never more
    first_end = streaming.events.index(("end", tasks[0].func))
    # the next submission follows the first batch's end at once, with two batches still in flight
    assert streaming.events[first_end + 1][0] == "submit"
    assert len([e for e in streaming.events[:first_end + 2] if e[0] == "submit"]) == 4
