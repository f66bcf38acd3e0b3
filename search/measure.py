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
from .rpc import NoServerError, ServerBusyError, copy_gbps_rpc, free_servers, run_candidate_rpc
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
        self.runners.warm()
        self.builders.warm()

    def measure(self, func, candidates: list[dict], dims: dict | None = None, on_result=None) -> list[Result]:
        """One Result per candidate, in order; `on_result(i, result)` is called as candidate i finishes."""
        return self.measure_round([(func, candidates, dims, on_result)])[0]

    def measure_round(self, batches: list[tuple]) -> list[list[Result]]:
        """Several tasks' batches at once, [(func, candidates, dims, on_result)]: the builders take
        every candidate of the round and the runners each as it is built, so that runners (RPC
        servers) do not wait for one task's builds at the end of each batch. One list of Results per
        batch, in order; `on_result(i, result)` of a batch is called as its candidate i finishes."""
        tasks = [(tvm.ir.save_json(func), dict(dims or {})) for func, _, dims, _ in batches]
        started, libs = time.monotonic(), []
        # first: the runners start on a task once its reference is there, so it never counts
        # against a candidate's timeout (the reference of a large layer takes longer than a build)
        # a task's runs go to the runner that ran it before where they can (an RPC server keeps the
        # task's tensors); its reference's file names the task
        homes = [reference_path(func_json, dims, self.scratch.name) for func_json, dims in tasks]
        referencing = {b for b, home in enumerate(homes) if not os.path.exists(home)}
        for b in sorted(referencing):
            self.builders.submit((REFERENCE, b), prepare_reference, (*tasks[b], self.scratch.name),
                                 max(self.timeout, REFERENCE_TIMEOUT_S))
        for b, (_, candidates, _, _) in enumerate(batches):
            for i, knobs in enumerate(candidates):
                self.builders.submit((b, i), self.builder, (tasks[b][0], self.target_json, knobs, self.scratch.name),
                                     self.timeout)
        outcome, built, jobs, last, busy = {}, [], {}, started, {}
        while not (self.builders.idle and self.runners.idle and not built):
            finished = []
            for job, answer in self.builders.poll():
                if job[0] == REFERENCE:  # if it failed, the runner computes the reference itself
                    referencing.discard(job[1])
                elif answer[0] == "ok":
                    built.append((job, answer[1]))
                else:
                    finished.append((job, answer))
            if self.overlap or self.builders.idle:  # a GPU candidate runs while others build
                ready = [(job, lib) for job, lib in built if job[0] not in referencing]
                for job, (lib, zeroed) in ready:
                    libs.append(lib)
                    func_json, dims = tasks[job[0]]
                    jobs[job] = (func_json, self.target_json, dims, self.scratch.name, lib, zeroed, *self.remote)
                    self.runners.submit(job, self.runner, jobs[job], self.timeout, affinity=homes[job[0]])
                built = [(job, lib) for job, lib in built if job[0] in referencing]
            running = not self.runners.idle
            for job, answer in finished + self.runners.poll():
                if answer[0] != "ok" and answer[1].startswith(ServerBusyError.__name__) \
                        and busy.get(job, 0) < BUSY_RETRIES:  # the servers are alive: the candidate waits its turn
                    busy[job] = busy.get(job, 0) + 1
                    self.runners.submit(job, self.runner, jobs[job], self.timeout, affinity=homes[job[0]])
                    continue
                if self._server_gone(answer):  # not the candidate's failure: it goes to another runner
                    self.runners.submit(job, self.runner, jobs[job], self.timeout, affinity=homes[job[0]])
                    continue
                outcome[job] = answer
                b, i = job
                if batches[b][3] is not None:
                    batches[b][3](i, _result(batches[b][1][i], answer))
            time.sleep(POLL_S)
            now = time.monotonic()
            self.seconds["run"] += (now - last) if running else 0.0
            last = now
        for lib in libs:
            os.unlink(lib)
        self.seconds["measure"] += time.monotonic() - started
        return [[_result(knobs, outcome[(b, i)]) for i, knobs in enumerate(batch[1])] for b, batch in enumerate(batches)]

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
        (answer,) = self.runners.map(self.runner, [(tvm.ir.save_json(func), self.target_json, dict(dims or {}),
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
