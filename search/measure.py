"""Measurement: candidates built in parallel workers (builder) and run one at a time in an isolated
one (runner), or on TVM's RPC servers one per server (rpc), each checked against the reference
(check) before it is timed; a crashed or overrunning worker is replaced (worker_pool), so a bad
candidate costs one trial."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

import tvm

from .builder import build_candidate
from .check import measured
from .rpc import NoServerError, ServerBusyError, copy_gbps_rpc, free_servers, registered_servers, run_candidate_rpc
from .runner import COPY_TIMEOUT_S, copy_gbps, prepare_reference, reference_path, run_candidate
from .worker_pool import POLL_S, Pool

REFERENCE = "reference"  # the builders' job that computes the task's reference ahead of the runner
REFERENCE_TIMEOUT_S = 600.0  # what that job may take (a large layer's CPU reference: tens of seconds)
BUSY_RETRIES = 30  # a candidate that finds every server busy goes back to the pool this often (each wait
# rpc.SERVER_WAIT_S) before its server counts as gone: a server finishing an overrun candidate frees later


@dataclass
class Result:
    knobs: dict
    us: list = field(default_factory=list)  # latency samples, empty on error
    error: str | None = None

    @property
    def best_us(self) -> float:
        return min(self.us) if self.us else float("inf")


def _result(knobs: dict, answer: tuple) -> Result:
    """A Result from a worker's (status, latencies or error text)."""
    status, value = answer
    return Result(knobs, value, None) if status == "ok" else Result(knobs, [], value)


class Measurer:
    """Builds in parallel and runs one candidate at a time, each as soon as it is built; keeps its
    workers across calls (one tuning run) and starts them when created."""

    def __init__(self, target, builders: int | None = None, timeout: float = 60.0,
                 builder=build_candidate, runner=run_candidate, rpc: tuple[str, str] | None = None):
        """`rpc`: (tracker HOST:PORT, key): run on the servers the tracker hands out, one runner
        per free server (search/rpc.py), instead of on this machine's device."""
        self.target_json, self.timeout = str(target), timeout
        # CPU timings here would feel the builds; a server's do not
        self.overlap = rpc is not None or tvm.target.Target(self.target_json).kind.name != "llvm"
        self.builder, self.remote = builder, tuple(rpc or ())
        self.runner, self.copy_runner = (run_candidate_rpc, copy_gbps_rpc) if rpc is not None else (runner, copy_gbps)
        self.builders = Pool(builders or min(8, os.cpu_count() or 1))
        self.runners = Pool(free_servers(*rpc) if rpc is not None else 1, spare=True)
        self.scratch = tempfile.TemporaryDirectory(prefix="tvm_ext_measure_")
        self.seconds = {"measure": 0.0, "run": 0.0}  # wall time measuring, and of it the runner's busy time
        # submitted batches by token; homes of references being made; built candidates waiting for
        # theirs; each running candidate's runner arguments; retries of candidates that found servers busy
        self._batches, self._tokens, self._referencing, self._built, self._jobs, self._busy = {}, 0, set(), [], {}, {}
        self._last = 0.0  # the previous poll (or the first submit) while candidates are in flight
        self.runners.warm()
        self.builders.warm()

    def measure(self, func, candidates: list[dict], dims: dict | None = None, on_result=None) -> list[Result]:
        """One Result per candidate, in order; `on_result(i, result)` is called as candidate i finishes."""
        return self.measure_round([(func, candidates, dims, on_result)])[0]

    def measure_round(self, batches: list[tuple]) -> list[list[Result]]:
        """Several tasks' batches at once, [(func, candidates, dims, on_result)]: one list of
        Results per batch, in order (submit each, poll until all are done)."""
        tokens = [self.submit(*batch) for batch in batches]
        done: dict = {}
        while len(done) < len(tokens):
            done.update(self.poll())
            time.sleep(POLL_S)
        return [done[token] for token in tokens]

    def submit(self, func, candidates: list[dict], dims: dict | None = None, on_result=None) -> int:
        """Queue one task's batch; a token that poll() returns with its Results once all are done.

        The builders take its candidates now, behind those queued before, and the task's reference
        first where no earlier batch made it (so it never counts against a candidate's timeout: a
        large layer's reference takes longer than a build); each candidate runs as soon as it is
        built and its task's reference is there, on the runner that ran the task before where it
        can (an RPC server keeps the task's tensors). `on_result(i, result)` as candidate i finishes."""
        task = (tvm.ir.save_json(measured(func, dims)), dict(dims or {}))
        home = reference_path(*task, self.scratch.name)  # the reference's file names the task
        if not os.path.exists(home) and home not in self._referencing:
            self._referencing.add(home)
            self.builders.submit((REFERENCE, home), prepare_reference, (*task, self.scratch.name),
                                 max(self.timeout, REFERENCE_TIMEOUT_S))
        token = self._tokens = self._tokens + 1
        self._last = self._last or time.monotonic()  # measuring from the first batch in flight
        self._batches[token] = {"task": task, "home": home, "candidates": list(candidates), "on_result": on_result,
                                "results": [None] * len(candidates), "left": len(candidates)}
        for i, knobs in enumerate(candidates):
            self.builders.submit((token, i), self.builder, (task[0], self.target_json, knobs, self.scratch.name),
                                 self.timeout)
        return token

    @property
    def in_flight(self) -> int:
        """Candidates submitted and not finished."""
        return sum(batch["left"] for batch in self._batches.values())

    def poll(self) -> list[tuple[int, list[Result]]]:
        """Start what can start, collect what ended: (token, Results) of each batch now complete."""
        finished = []
        for job, answer in self.builders.poll():
            if job[0] == REFERENCE:  # if it failed, the runner computes the reference itself
                self._referencing.discard(job[1])
            elif answer[0] == "ok":
                self._built.append((job, answer[1]))
            else:
                finished.append((job, answer))
        if self.overlap or self.builders.idle:  # a GPU candidate runs while others build
            waiting = []
            for job, (lib, zeroed) in self._built:
                batch = self._batches[job[0]]
                if batch["home"] in self._referencing:
                    waiting.append((job, (lib, zeroed)))
                    continue
                func_json, dims = batch["task"]
                self._jobs[job] = (func_json, self.target_json, dims, self.scratch.name, lib, zeroed, *self.remote)
                self._run(job)
            self._built = waiting
        running = not self.runners.idle
        for job, answer in finished + self.runners.poll():
            if answer[0] != "ok" and answer[1].startswith(ServerBusyError.__name__) \
                    and self._busy.get(job, 0) < BUSY_RETRIES and self._server_left_over():  # it waits its turn
                self._busy[job] = self._busy.get(job, 0) + 1
                self._run(job)
                continue
            if self._server_gone(answer):  # not the candidate's failure: it goes to another runner
                self._run(job)
                continue
            self._finish(job, answer)
        now = time.monotonic()
        if self._last:
            self.seconds["measure"] += now - self._last
            self.seconds["run"] += (now - self._last) if running else 0.0
        self._last = now if self.in_flight else 0.0
        done = [(token, batch["results"]) for token, batch in self._batches.items() if not batch["left"]]
        for token, _ in done:
            del self._batches[token]
        return done

    def _run(self, job: tuple) -> None:
        """Hand built candidate `job` to the runners, its task's runner first (Pool affinity)."""
        self.runners.submit(job, self.runner, self._jobs[job], self.timeout, affinity=self._batches[job[0]]["home"])

    def _finish(self, job: tuple, answer: tuple) -> None:
        """Record candidate `job`'s outcome; its library is no longer needed."""
        token, i = job
        batch = self._batches[token]
        result = batch["results"][i] = _result(batch["candidates"][i], answer)
        batch["left"] -= 1
        self._busy.pop(job, None)
        args = self._jobs.pop(job, None)
        if args is not None and os.path.exists(args[4]):
            os.unlink(args[4])
        if batch["on_result"] is not None:
            batch["on_result"](i, result)

    def _server_left_over(self) -> bool:
        """Whether the tracker has more servers than the other runners hold (each keeps its own for
        the run): one finishing an overrun candidate, free later. Else a server died and its runner's
        successor would wait BUSY_RETRIES times for a server a sibling holds."""
        return registered_servers(*self.remote) > self.runners.size - 1

    def _server_gone(self, answer: tuple) -> bool:
        """Whether a runner's `answer` says its server is gone; the pool then runs one runner fewer."""
        if answer[0] == "ok" or not answer[1].startswith((NoServerError.__name__, ServerBusyError.__name__)):
            return False
        if self.runners.size == 1:
            raise ConnectionError(f"every RPC server under key {self.remote[1]!r} is gone ({answer[1]})")
        self.runners.shrink()
        return True

    def time_library(self, func, lib_path: str, dims: dict | None = None) -> Result:
        """Check and time a library built elsewhere (e.g. by MetaSchedule) for `func`, exactly as
        candidates are: same runner, reference, timer."""
        (answer,) = self.runners.map(self.runner, [(tvm.ir.save_json(measured(func, dims)), self.target_json, dict(dims or {}),
                                                    self.scratch.name, lib_path, [], *self.remote)], self.timeout)
        return _result({}, answer)

    def copy_gbps(self) -> float:
        """The device's copy bandwidth, the report's yardstick (not a candidate: the tuner's --timeout
        does not bound it, COPY_TIMEOUT_S does)."""
        (status, value), = self.runners.map(self.copy_runner, [(self.target_json, *self.remote)], COPY_TIMEOUT_S)
        if status != "ok":
            raise RuntimeError(f"could not time a device copy: {value}")
        return value

    def close(self) -> None:
        self.builders.close()
        self.runners.close()
        self.scratch.cleanup()

    def __enter__(self) -> "Measurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure(func, target, candidates: list[dict], dims: dict | None = None, timeout: float = 60.0,
            **workers) -> list[Result]:
    """One-shot measurement (starts and stops its own workers)."""
    with Measurer(target, timeout=timeout, **workers) as measurer:
        return measurer.measure(func, candidates, dims)
