"""Task scheduler: spend one trial budget across a model's tasks where it pays most.

Batches stream: the scheduler keeps about ROUND candidates a runner in flight and hands the
measurer a task's next batch as soon as another's ends (so runners never wait for a round's last
candidate, or for the builds of the next). Tasks never measured come first (also in a resumed run),
then the task with the largest expected gain x weight (best latency times the last relative
improvement, floored by the unexplored share, times the call count) and those within PEERS of the
largest gain of any task, its own batch in flight or not; a task has one batch in flight at a time.
A measurer that measures whole rounds (an oracle's, each_batch) gets them as before: the batches
queued until it is asked for results."""

from __future__ import annotations

import time

from tqdm import tqdm

from .strategy import TaskSearch
from .worker_pool import POLL_S

FLOOR = 0.02  # expected relative improvement of a batch over an unexplored space
ROUND = 24  # candidates kept in flight for each runner: three batches of the default size
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


class Rounds:
    """submit/poll over a measurer of whole rounds, `measure(batches) -> [[Result]]`: the batches
    submitted since the last poll are measured together when it is called."""

    def __init__(self, measure):
        self.measure, self.queued, self.tokens = measure, [], 0

    def submit(self, func, candidates, dims=None, on_result=None) -> int:
        self.tokens += 1
        self.queued.append((self.tokens, (func, candidates, dims, on_result)))
        return self.tokens

    def poll(self) -> list:
        queued, self.queued = self.queued, []
        return list(zip([token for token, _ in queued], self.measure([batch for _, batch in queued]))) if queued else []


def tune(searches: list[TaskSearch], measure, trials: int, prior: list = (), progress: bool = True,
         runners: int = 1) -> list[TaskSearch]:
    """Run `searches` with at most `trials` new measurements over all of them. `measure`: a
    streaming measurer (submit(func, candidates, dims, on_result) -> token; poll() -> [(token,
    Results)] of the batches ended since, as Measurer has), or a function measuring a round,
    [(func, candidates, dims, on_result)] -> [[Result]]. `runners`: candidates measured at once
    (RPC servers); ROUND candidates for each are kept in flight, so that builds stay ahead of runs."""
    measurer = measure if hasattr(measure, "submit") else Rounds(measure)

    def retrain(search):
        if not search.done:  # a finished task proposes nothing more: its model would go unused
            search.retrain(list(prior) + [other.own_group() for other in searches if other is not search])

    for search in searches:
        retrain(search)
    overall = tqdm(total=trials, desc="all tasks", disable=not progress, position=0)
    bars = {id(s): tqdm(total=s.budget, initial=len(s.measured), desc=s.task.name, disable=not progress,
                        position=i + 1, leave=False) for i, s in enumerate(searches)}
    spent, flying = 0, {}  # token -> batch in flight

    def top_up():
        planned = sum(len(b.chosen) for b in flying.values())
        busy = {id(b.search) for b in flying.values()}
        live = [s for s in searches if not s.done]
        ranked = sorted([s for s in live if s.measured], key=_gain, reverse=True)
        top = _gain(ranked[0]) if ranked else 0.0
        fresh = [s for s in live if not s.measured]  # a resumed run's measured tasks are not fresh
        for search in fresh + [s for s in ranked if _gain(s) >= PEERS * top]:
            if planned >= min(ROUND * runners, trials - spent):
                break
            if id(search) in busy:
                continue
            batch = search.propose(trials - spent - planned)
            if batch.chosen:
                flying[measurer.submit(search.task.func, batch.candidates, search.dims, batch.on_result)] = batch
                planned += len(batch.chosen)

    top_up()
    while flying:
        ended = measurer.poll()
        if not ended:
            time.sleep(POLL_S)
            continue
        for token, measured in ended:
            batch = flying.pop(token)
            n = batch.close(measured)
            spent += n
            search = batch.search
            retrain(search)
            overall.update(n)
            bars[id(search)].update(n)
            best = f"best {search.best_us:.1f} us" if search.best else "no valid candidate yet"
            bars[id(search)].set_postfix_str(f"{best}, {search.stop_reason}" if search.done else best)
        top_up()
    if spent < trials:  # every task stopped before the budget: say why rather than halt part-way
        reasons = sorted({s.stop_reason for s in searches})
        overall.total = spent
        overall.set_postfix_str(f"stopped at {spent} of {trials} trials: {', '.join(reasons)}")
        overall.refresh()
    for bar in bars.values():
        bar.close()
    overall.close()
    return searches
