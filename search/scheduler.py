"""Task scheduler: spend one trial budget across a model's tasks where it pays most.

After one batch each (tasks never measured first, also in a resumed run), the next batch goes to
the task with the largest expected gain x weight (its best latency times its last relative
improvement, floored by its unexplored share, times its call count)."""

from __future__ import annotations

from tqdm import tqdm

from .strategy import TaskSearch

FLOOR = 0.02  # expected relative improvement of a batch over an unexplored space


def _gain(search: TaskSearch) -> float:
    unexplored = 1 - len(search.measured) / max(1, len(search.points))
    expected = max(search.improvement, FLOOR * unexplored)
    best = search.best_us if search.best else 1.0
    return search.task.weight * best * expected


def tune(searches: list[TaskSearch], measure, trials: int, prior: list = (), progress: bool = True) -> list[TaskSearch]:
    """Run `searches` with at most `trials` new measurements over all of them."""
    def retrain(search):
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
        search = fresh[0] if fresh else max(live, key=_gain)
        n = search.step(measure, trials - spent)
        spent += n
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
