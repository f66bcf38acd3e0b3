"""Measurement: build and time candidates in isolated processes, and check them against a reference.

Each candidate runs in its own fresh process (spawn) with a time limit, so a candidate that
crashes or hangs costs one trial and never the tuning run. Before timing, its outputs are compared
with the task's reference (the same function as TVM builds it without our schedules): a wrong
result is an error, never a latency. Inputs are random; symbolic dims take the values given.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field

import numpy as np
import tvm

REPEAT = 5


@dataclass
class Result:
    knobs: dict
    us: list = field(default_factory=list)  # latency samples, empty on error
    error: str | None = None

    @property
    def best_us(self) -> float:
        return min(self.us) if self.us else float("inf")


def _concrete(shape, dims: dict) -> list[int]:
    return [int(d.value) if hasattr(d, "value") else int(dims[d.name]) for d in shape]


def _arrays(func, dims: dict, rng) -> list[np.ndarray]:
    """Random inputs, zeroed outputs, for every parameter buffer of `func`."""
    arrays = []
    for i, param in enumerate(func.params):
        shape, dtype = _concrete(param.shape, dims), str(param.ty.dtype)
        is_input = i < len(func.params) - 1
        arrays.append(rng.standard_normal(shape).astype(dtype) if is_input and "float" in dtype else
                      np.zeros(shape, dtype))
    return arrays


def run_candidate(func_json: str, target_json: str, knobs: dict, dims: dict, repeat: int = REPEAT) -> list[float]:
    """In the worker: schedule, build, check against the unscheduled build, time. Latencies in us."""
    import tvm_ext  # noqa: F401,PLC0415  (registers our reducers and passes in this fresh process)
    import schedules  # noqa: PLC0415
    from schedules.grid_reduce import ZEROED_INPUTS  # noqa: PLC0415
    from tvm_ext.passes import TIR_PIPELINE  # noqa: PLC0415

    func, target = tvm.ir.load_json(func_json), tvm.target.Target(target_json)
    sch = schedules.schedule(func, target, knobs)
    if sch is None:
        raise ValueError(f"the template refuses knobs {knobs}")
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    device = tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name)
    rng = np.random.default_rng(0)
    inputs = _arrays(func, dims, rng)
    reference = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    expected = [tvm.runtime.tensor(a) for a in inputs]
    reference["main"](*expected)
    extra = [np.zeros(shape, dtype) for shape, dtype in (scheduled.attrs or {}).get(ZEROED_INPUTS, [])]
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=target, tir_pipeline=TIR_PIPELINE)
    args = [tvm.runtime.tensor(a, device) for a in inputs[:-1] + extra + inputs[-1:]]
    lib["main"](*args)
    got, want = args[-1].numpy().astype("float64"), expected[-1].numpy().astype("float64")
    tolerance = 2e-2 if "16" in str(func.params[-1].ty.dtype) else 1e-4
    if not np.allclose(got, want, rtol=tolerance, atol=tolerance * max(1.0, float(np.abs(want).max()))):
        raise ValueError(f"wrong result: max abs error {float(np.abs(got - want).max()):.3g}")
    timer = lib.mod.time_evaluator("main", device, number=10, repeat=repeat)
    return [t * 1e6 for t in timer(*args).results]


def _worker(results, runner, args):
    try:
        results.put(("ok", runner(*args)))
    except BaseException as err:  # everything a candidate can throw is its error, reported
        results.put(("error", f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err) else ''}"))


def _await(channel, worker, timeout: float) -> tuple[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return channel.get(timeout=0.2)
        except queue.Empty:
            if not worker.is_alive():  # it may have answered just before it ended
                try:
                    return channel.get(timeout=0.5)
                except queue.Empty:
                    return "error", f"the worker died (exit code {worker.exitcode})"
            if time.monotonic() > deadline:
                return "error", f"timed out after {timeout:g} s"


def measure(func, target, candidates: list[dict], dims: dict | None = None, timeout: float = 60.0,
            runner=run_candidate) -> list[Result]:
    """One Result per candidate, each measured in a fresh process within `timeout` seconds."""
    context = mp.get_context("spawn")
    func_json, target_json = tvm.ir.save_json(func), str(target)
    results = []
    for knobs in candidates:
        channel = context.Queue()
        worker = context.Process(target=_worker, args=(channel, runner, (func_json, target_json, knobs, dims or {})))
        worker.start()
        status, value = _await(channel, worker, timeout)
        worker.join(1)
        if worker.is_alive():
            worker.kill()
            worker.join()
        results.append(Result(knobs, value, None) if status == "ok" else Result(knobs, [], value))
    return results
