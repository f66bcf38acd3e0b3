"""Worker pool: spawned processes that run one job at a time, replaced when a job fails or overruns."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections import deque

POLL_S = 0.005  # how long the tuner sleeps between looks at its workers (a runner idles up to this long)
PARENT_POLL_S = 1.0  # how often a worker checks that the tuner that started it is alive
START_S = 300.0  # seconds a spawned worker may take to import TVM before it is given up on
WORKER_DID_NOT_START = "the measuring worker did not start"  # a failure of the machinery, not of the candidate:
# its records do not count as measured, so a resumed run measures the point again


def _error_text(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


def _exit_with_parent() -> None:
    """End this worker within a second of its parent's death (a SIGKILLed tuner cleans up nothing):
    an orphan would hold the caller's pipes open and its memory for as long as its job ran."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _serve(jobs, results):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the tuner's to handle: it stops the workers
    _exit_with_parent()
    results.put(("ready", None))  # imports done: from now on a job's time is its own
    while (job := jobs.get()) is not None:
        fn, args = job
        try:
            results.put(("ok", fn(*args)))
        except BaseException as err:  # everything a candidate can throw is its error, reported
            results.put(("error", _error_text(err)))


class Worker:
    """A spawned process that runs one job at a time. A job's `timeout` counts from when both the
    job is submitted and the worker has finished starting (importing TVM takes seconds, more on a
    busy machine): a candidate is never timed out for the worker's start-up."""

    def __init__(self, context):
        self.jobs, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=_serve, args=(self.jobs, self.results), daemon=True)
        self.process.start()
        self.job, self.created, self.started, self.ready = None, time.monotonic(), 0.0, False

    def submit(self, job_id, fn, args) -> None:
        self.job, self.started = job_id, time.monotonic()
        self.jobs.put((fn, args))

    def poll(self, timeout: float):
        """(status, value) of the running job when it has ended, else None."""
        try:
            answer = self.results.get_nowait()
            if answer[0] != "ready":
                return answer
            self.ready, self.started = True, time.monotonic()
        except queue.Empty:
            pass
        if not self.ready and self.process.is_alive():
            if time.monotonic() - self.created > START_S:
                return "error", f"{WORKER_DID_NOT_START} within {START_S:g} s"
            return None
        if not self.process.is_alive():
            try:  # it may have answered just before it ended
                return self.results.get(timeout=0.5)
            except queue.Empty:
                return "error", f"the worker died (exit code {self.process.exitcode})"
        if time.monotonic() - self.started > timeout:
            return "error", f"timed out after {timeout:g} s"
        return None

    def stop(self) -> None:
        """Ask the worker to exit once its current job is done."""
        if self.process.is_alive():
            self.jobs.put(None)

    def close(self, kill: bool = False) -> None:
        """Wait briefly for a stopped worker to exit (`kill`: not at all), then kill it if it has not."""
        if not kill:
            self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Pool:
    """Up to `size` workers taking submitted jobs in order; a worker whose job failed is replaced
    before it takes another. With `spare`, one more worker is kept started so that a replacement
    does not wait for TVM's import.

    A job may name an `affinity` (the task it measures): a free worker takes a job of a task it
    ran before first (an RPC runner keeps a task's tensors on its server: paid once, not once a
    server), then one of a task no worker ran yet, then any, so no worker idles while jobs wait."""

    def __init__(self, size: int, spare: bool = False):
        self.context, self.size, self.spare = mp.get_context("spawn"), size, spare
        self.workers: list = []
        self.reserve = None
        self.pending: deque = deque()  # (job id, fn, args, timeout, affinity) not started yet
        self.busy: dict = {}  # worker -> timeout of its job
        self.homes: dict = {}  # affinity -> the worker that first ran one of its jobs

    def _fresh(self) -> Worker:
        worker, self.reserve = self.reserve or Worker(self.context), None
        if self.spare:
            self.reserve = Worker(self.context)
        return worker

    def warm(self) -> None:
        """Start every worker now, so that TVM's import overlaps with the caller's own work."""
        while len(self.workers) < self.size:
            self.workers.append(self._fresh())

    def submit(self, job_id, fn, args, timeout: float, affinity=None) -> None:
        self.pending.append((job_id, fn, args, timeout, affinity))

    def _take(self, worker: Worker) -> tuple:
        """The pending job `worker` starts next (see the class's affinity order)."""
        for wanted in (lambda a: a is not None and self.homes.get(a) is worker,
                       lambda a: a is None or a not in self.homes, lambda a: True):
            for k, job in enumerate(self.pending):
                if wanted(job[4]):
                    del self.pending[k]
                    if job[4] is not None:
                        self.homes.setdefault(job[4], worker)
                    return job
        raise LookupError("no pending job")

    @property
    def idle(self) -> bool:
        return not self.pending and not self.busy

    def poll(self) -> list:
        """(job id, (status, value)) of each job that has ended; then pending jobs start on the free
        workers, those just freed included (a runner waits for no second call between candidates)."""
        ended = []
        for worker, timeout in list(self.busy.items()):
            answer = worker.poll(timeout)
            if answer is None:
                continue
            ended.append((worker.job, answer))
            del self.busy[worker]
            if answer[0] != "ok":
                worker.close(kill=True)
                self.workers[self.workers.index(worker)] = self._fresh()
                self._forget(worker)
        while self.pending and len(self.workers) < self.size and len(self.busy) == len(self.workers):
            self.workers.append(self._fresh())
        for worker in [w for w in self.workers if w not in self.busy]:
            if not self.pending:
                break
            job_id, fn, args, timeout, _ = self._take(worker)
            worker.submit(job_id, fn, args)
            self.busy[worker] = timeout
        return ended

    def shrink(self) -> None:
        """Run one worker fewer from now on (an idle one is stopped)."""
        self.size -= 1
        idle = next((w for w in self.workers if w not in self.busy), None)
        if idle is not None:
            self.workers.remove(idle)
            self._forget(idle)
            idle.stop()
            idle.close()

    def _forget(self, worker: Worker) -> None:
        """Tasks `worker` ran find a new home: it is gone, and what it kept with it."""
        self.homes = {a: w for a, w in self.homes.items() if w is not worker}

    def map(self, fn, jobs: list, timeout: float) -> list:
        """(status, value) of fn(*args) for each args of `jobs`, in order."""
        for i, args in enumerate(jobs):
            self.submit(i, fn, args, timeout)
        out = [None] * len(jobs)
        while not self.idle:
            for i, answer in self.poll():
                out[i] = answer
            time.sleep(POLL_S)
        return out

    def close(self) -> None:
        """Ask every worker to stop, then wait for them together (each takes a while to tear TVM down)."""
        workers = self.workers + ([self.reserve] if self.reserve else [])
        for worker in workers:
            worker.stop()
        for worker in workers:
            worker.close()
        self.workers, self.reserve = [], None
