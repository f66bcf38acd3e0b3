"""Task scheduler: spend one trial budget across a model's tasks where it pays most.

Tasks are measured in rounds of several tasks' batches at once (about ROUND candidates a runner:
the measurer builds them all and runs each as it is built, so runners never wait for one task's
builds). Tasks never measured come first (also in a resumed run), then the task with the largest
expected gain x weight (best latency times the last relative improvement, floored by the
unexplored share, times the call count) and those within PEERS of its gain."""

from __future__ import annotations

from tqdm import tqdm

from .strategy import TaskSearch

FLOOR = 0.02  # expected relative improvement of a batch over an unexplored space
ROUND = 24  # candidates a round aims for, a runner: three batches of the default size
PEERS = 0.5  # a measured task joins a round whose best task's expected gain is at most 1 / PEERS its own


def _gain(search: TaskSearch) -> float:
    unexplored = 1 - len(search.measured) / max(1, len(search.points))
    expected = max(search.improvement, FLOOR * unexplored)
    best = search.best_us if search.best else 1.0
    return search.task.weight * best * expected


def each_batch(measure):
    """A round measurer from a measurer of one batch, `measure(func, candidates, dims, on_result=)`
    (an oracle's): the round's batches one after another."""
    return lambda batches: [measure(func, candidates, dims, on_result=log) for func, candidates, dims, log in batches]


def tune(searches: list[TaskSearch], measure, trials: int, prior: list = (), progress: bool = True,
         runners: int = 1) -> list[TaskSearch]:
    """Run `searches` with at most `trials` new measurements over all of them; `measure(batches)`
    measures a round, [(func, candidates, dims, on_result)] -> [[Result]] (Measurer.measure_round).
    `runners`: candidates measured at once (RPC servers); a round takes ROUND candidates for each,
    so that what a round costs besides its runs (its first builds, its last candidate's tail, the
    retraining and proposals between rounds) is shared by as many candidates a runner."""
    def retrain(search):
        if not search.done:  # a finished task proposes nothing more: its model would go unused
            search.retrain(list(prior) + [other.own_group() for other in searches if other is not search])

    for search in searches:
        retrain(search)
    overall = tqdm(total=trials, desc="all tasks", disable=not progress, position=0)
    bars = {id(s): tqdm(total=s.budget, initial=len(s.measured), desc=s.task.name, disable=not progress,
                        position=i + 1, leave=False) for i, s in enumerate(searches)}
    spent = 0
    while spent < trials:
        live = [s for s in searches if not s.done]
        if not live:
            break
        fresh = [s for s in live if not s.measured]  # a resumed run's measured tasks are not fresh
        batches, planned = [], 0
        ranked = sorted([s for s in live if s.measured], key=_gain, reverse=True)
        peers = [s for s in ranked if _gain(s) >= PEERS * _gain(ranked[0])]
        for search in fresh + peers:
            if planned >= min(ROUND * runners, trials - spent):
                break
            batch = search.propose(trials - spent - planned)
            if batch.chosen:
                batches.append(batch)
                planned += len(batch.chosen)
        results = measure([(b.search.task.func, b.candidates, b.search.dims, b.on_result) for b in batches])
        for batch, measured in zip(batches, results):
            n = batch.close(measured)
            spent += n
            search = batch.search
            retrain(search)
            overall.update(n)
            bars[id(search)].update(n)
            best = f"best {search.best_us:.1f} us" if search.best else "no valid candidate yet"
            bars[id(search)].set_postfix_str(f"{best}, {search.stop_reason}" if search.done else best)
    if spent < trials:  # every task stopped before the budget: say why rather than halt part-way
        reasons = sorted({s.stop_reason for s in searches})
        overall.total = spent
        overall.set_postfix_str(f"stopped at {spent} of {trials} trials: {', '.join(reasons)}")
        overall.refresh()
    for bar in bars.values():
        bar.close()
    overall.close()
    return searches
