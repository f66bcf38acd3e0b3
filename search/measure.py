"""Measurement: build candidates in parallel worker processes, run them in an isolated one.

Each output is checked against TVM's unscheduled CPU build before timing: a wrong result is an
error, never a latency. Long-lived workers are replaced when a job crashes or overruns, so a bad
candidate costs one trial. On a GPU, L2 is flushed before every timed call."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.ir.expr import TensorLoad, TensorRegion
from tvm.ir.prim.expr import Cast

from tvm_ext.schedules import conv2d, matmul

from .features import NOMINAL

REPEAT = 20  # timed calls per candidate on a GPU (each after an L2 flush); CPU: repeats of 10 calls
FLUSH_BYTES = 256 << 20  # twice the largest L2 we target
POLL_S = 0.01
COPY_TIMEOUT_S = 120.0  # seconds the copy-bandwidth measurement may take
PARENT_POLL_S = 1.0  # how often a worker checks that the tuner that started it is alive
START_S = 300.0  # seconds a spawned worker may take to import TVM before it is given up on
WORKER_DID_NOT_START = "the measuring worker did not start"  # a failure of the machinery, not of the candidate:
# its records do not count as measured, so a resumed run measures the point again


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


def _device(target):
    return tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name)


def _error_text(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


# ---- what the workers run ------------------------------------------------------------------

def build_candidate(func_json: str, target_json: str, knobs: dict, out_dir: str) -> tuple[str, list]:
    """Schedule and compile one candidate; (library path, shapes of the zero-filled inputs it needs)."""
    from tvm_ext import schedules  # noqa: PLC0415  (imports here: this runs in a fresh worker)
    import tvm_ext  # noqa: F401,PLC0415  (registers our reducers, passes and source hook)
    from tvm_ext.schedules.contracts import ZEROED_INPUTS  # noqa: PLC0415
    from tvm_ext.tir import TIR_PIPELINE  # noqa: PLC0415

    func, target = tvm.ir.load_json(func_json), tvm.target.Target(target_json)
    sch = schedules.schedule(func, target, knobs)
    if sch is None:
        raise ValueError(f"the template refuses knobs {knobs}")
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=target, tir_pipeline=TIR_PIPELINE)
    fd, path = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    lib.export_library(path)
    return path, [(list(shape), dtype) for shape, dtype in (scheduled.attrs or {}).get(ZEROED_INPUTS, [])]


def _concrete(shape, dims: dict) -> list[int]:
    """A buffer shape with symbolic dims set to `dims` (NOMINAL where not given)."""
    return [int(d.value) if hasattr(d, "value") else int(dims.get(d.name, NOMINAL)) for d in shape]


def task_bytes(func, dims: dict | None = None) -> int:
    """Bytes of every parameter buffer: what must cross memory at least once."""
    return sum(int(np.prod(_concrete(p.shape, dims or {}))) * tvm.DataType(str(p.ty.dtype)).bits // 8
               for p in func.params)


def _random(rng, shape, dtype: str) -> np.ndarray:
    """Seeded standard-normal values in `dtype`; bfloat16 by truncating float32 bits (ml_dtypes' own
    conversion takes seconds on a large tensor)."""
    values = rng.standard_normal(shape, dtype="float32")
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(dtype)
    return values.astype(dtype)


def output_count(func) -> int:
    """How many of `func`'s parameters are outputs: the trailing ones it stores to (call_tir passes
    the outputs last; add + RMSNorm writes the residual sum and the norm)."""
    stored = []
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda st: stored.append(st.buffer)), order="pre")
    written = [any(p.same_as(b) for b in stored) for p in func.params]
    if True not in written:
        raise ValueError("the task's function writes none of its parameters: it has no output to check")
    return len(written) - written.index(True)


def _arrays(func, dims: dict) -> list[np.ndarray]:
    """Seeded random inputs and zeroed outputs for every parameter buffer of `func`."""
    rng, arrays, inputs = np.random.default_rng(0), [], len(func.params) - output_count(func)
    for i, param in enumerate(func.params):
        shape, dtype = _concrete(param.shape, dims), str(param.ty.dtype)
        arrays.append(_random(rng, shape, dtype) if i < inputs and "float" in dtype else np.zeros(shape, dtype))
    return arrays


def _float32_inputs(func, params=None):
    """`func` with its bfloat16 inputs (or the inputs `params`, where they are only read through a
    cast to float32) read as float32 buffers, for the CPU reference: there TVM 0.27's bf16
    legalization computes reductions with several outputs (Welford) wrongly (error 17.7 on a bf16
    LayerNorm; 0.03 this way), and fp16 matmul operands are converted in software, element by element."""
    inputs = func.params[:len(func.params) - output_count(func)]
    params = params if params is not None else [p for p in inputs if str(p.ty.dtype) == "bfloat16"]
    remap = {i: tirx.decl_buffer(p.shape, "float32", p.name) for i, p in enumerate(inputs)
             if any(p.same_as(q) for q in params)}
    if not remap:
        return func

    def new_of(buffer):
        return next((remap[i] for i in remap if func.params[i].same_as(buffer)), None)

    def cast(node):
        new = new_of(node.value.source) if isinstance(node.value, TensorLoad) and str(node.ty.dtype) == "float32" else None
        return node if new is None else tirx.BufferLoad(new, node.value.indices)

    def region(node):
        new = new_of(node.source)
        return node if new is None else tirx.BufferRegion(new, node.region)

    body = tvm_ffi.structural_map(func.body, [(Cast, cast), (TensorRegion, region)])
    return tirx.PrimFunc([remap.get(i, p) for i, p in enumerate(func.params)], body, func.ret_type, func.attrs)


REFERENCE_LANES = 16  # float32 columns per vector in a matmul reference


def _reference(func) -> tirx.PrimFunc:
    """What computes the task's reference on the CPU: `func` unscheduled, or for a matmul, its
    operands read as float32 and its loops parallel over rows and vectorised over columns (the
    unscheduled form of a large fp16 Linear is too slow on a CPU to serve as a reference)."""
    convolution = conv2d.convolution(func)
    if convolution is not None:
        return _conv2d_reference(convolution)
    found = matmul.contraction(func, over_c=False)  # the epilogue blocks stay plain loops
    operands = [x.source for x in matmul.multiply_accumulate(found[0].get(found[1]).body)] if found else []
    if not operands or "float" not in str(operands[0].dtype):
        return _float32_inputs(func)
    sch, block, _ = found
    *batch, i, j, k = sch.get_loops(block)
    sch.reorder(i, k, j)
    sch.parallel(sch.fuse(*batch, i))
    if int(sch.get(j).extent) % REFERENCE_LANES == 0:
        sch.vectorize(sch.split(j, [None, REFERENCE_LANES])[1])
    return _float32_inputs(sch.mod["main"], operands)


def _conv2d_reference(convolution) -> tirx.PrimFunc:
    """A convolution for the CPU reference: parallel over images and output channels, the padding
    computed per image and channel, each tap a vectorised pass over an output row (the unscheduled
    32 x 256 x 56 x 56 layer would take minutes)."""
    sch, pads, block, _ = convolution
    n, f, y, x, c, r, s = sch.get_loops(block)
    sch.reorder(n, f, c, r, s, y, x)
    outer = sch.fuse(n, f)
    sch.parallel(outer)
    for pad in pads:
        sch.compute_at(pad, outer)
    sch.vectorize(x)
    return sch.mod["main"]


ELEMENT_ULPS = 8  # one element may be off by this many ulps of the output dtype at its row's largest value
MASS_ULPS = 2  # a row's errors may add up to this many ulps of its summed magnitude
FLOAT32_TOLERANCE = 1e-3  # float32's floor on both: its errors are the reference's long float32 sums, not rounding
NOISE = 2.0 ** -16  # of the tensor's largest |value|: any element may be off by this much (see output_bounds)


def tolerances(dtype: str) -> tuple[float, float]:
    """(element, mass) tolerances of an output dtype, relative to a row's largest and summed |value|:
    float16 0.0078 and 0.002, bfloat16 0.0625 and 0.0156, float32 0.001 and 0.001; 0 for integers
    (exact). A correct candidate differs from the reference by about one rounding of the output
    (measured on the suite: under 0.5 ulp per element, 0.2-0.5 ulp summed) plus, in float32, the
    error of the reference's sequential float32 sums (up to 1.3e-4 relative on a 401408-long
    variance); a row 14% off, doubled, constant or zeroed is off by far more."""
    if "float" not in dtype:
        return 0.0, 0.0
    eps = float(ml_dtypes.finfo(np.dtype(dtype)).eps)
    return max(ELEMENT_ULPS * eps, FLOAT32_TOLERANCE), max(MASS_ULPS * eps, FLOAT32_TOLERANCE)


def _rows(shape) -> tuple[int, int]:
    """(rows, width) an output is checked by: rows along its last axis where it has two or more
    axes longer than 1 (a norm's or a softmax's rows), else one row holding the whole tensor (a sum)."""
    long_axes, size = [d for d in shape if d != 1], int(np.prod(shape))
    width = long_axes[-1] if len(long_axes) >= 2 else size
    return (size // width, width) if width else (0, 0)


@dataclass
class _Output:
    """What one output of a task must be: the reference by rows, and each row's error bounds."""
    name: str
    dtype: str
    want: np.ndarray  # float32, (rows, width); zero where the reference is NaN or infinite
    special: np.ndarray  # flat positions where the reference is NaN or infinite ...
    special_want: np.ndarray  # ... and its values there, which a candidate must repeat
    element_bound: np.ndarray  # per row: the largest |got - want| of one element
    mass_bound: np.ndarray  # per row: the largest sum of |got - want|


def output_bounds(want: np.ndarray, dtype: str, name: str) -> _Output:
    """An _Output for reference `want` of an output of `dtype`: per row, |got - want| <= element x
    the row's largest |want| for every element, and sum |got - want| <= mass x sum |want| (see
    tolerances), but never less than NOISE of the tensor's largest |want| per element: a value the
    reference cancels to zero (a ReLU'd row) keeps a candidate's float32 accumulation noise."""
    element, mass = tolerances(dtype)
    flat = want.astype("float32").reshape(_rows(want.shape))
    special = np.flatnonzero(~np.isfinite(flat))
    special_want = flat.reshape(-1)[special]
    flat.reshape(-1)[special] = 0
    magnitude = np.abs(flat)
    noise = NOISE * float(magnitude.max(initial=0))
    return _Output(name, dtype, flat, special, special_want, np.maximum(element * magnitude.max(-1, initial=0), noise),
                   np.maximum(mass * magnitude.sum(-1), noise * flat.shape[1]))


@dataclass
class _Expected:
    """A task's inputs on the device and what its outputs must be, kept by the runner across candidates."""
    inputs: list
    outputs: list  # one _Output per output parameter
    poison: list  # per output, a device tensor of its shape no correct candidate leaves in place


_EXPECTED: dict = {}  # in a runner: the current task's _Expected
CHECK_CHUNK = 1 << 20  # elements compared per thread at a time (fits in cache)


def _expected(func_json: str, dims: dict, device, scratch: str) -> _Expected:
    """The task's _Expected: the unscheduled function built for the CPU computes the reference once
    per tuning run, and a file in `scratch` lets a replaced runner reload it instead."""
    key = hashlib.sha1(f"{func_json}{sorted(dims.items())}".encode()).hexdigest()
    if key not in _EXPECTED:
        _EXPECTED.clear()  # one task at a time: free the last one's device memory
        func = tvm.ir.load_json(func_json)
        outputs = output_count(func)
        path = os.path.join(scratch, f"reference-{key}.npz")
        if os.path.exists(path):
            with np.load(path) as saved:  # bfloat16 comes back as raw 2-byte records: view it again
                arrays = [saved[f"a{i}"].view(str(p.ty.dtype)) for i, p in enumerate(func.params)]
        else:
            arrays = _arrays(func, dims)
            reference = _reference(func)
            lib = tvm.compile(tvm.IRModule({"main": reference.with_attr("global_symbol", "main")}), target="llvm")
            args = [tvm.runtime.tensor(a.astype(str(p.ty.dtype), copy=False)) for a, p in zip(arrays, reference.params)]
            lib["main"](*args)
            arrays[-outputs:] = [a.numpy() for a in args[-outputs:]]
            np.savez(path + ".tmp.npz", **{f"a{i}": a for i, a in enumerate(arrays)})
            os.replace(path + ".tmp.npz", path)
        params, wants = func.params[-outputs:], arrays[-outputs:]
        _EXPECTED[key] = _Expected(
            [tvm.runtime.tensor(a, device) for a in arrays[:-outputs]],
            [output_bounds(w, str(p.ty.dtype), p.name) for w, p in zip(wants, params)],
            [tvm.runtime.tensor(np.full(w.shape, np.nan if "float" in str(w.dtype) else -7, w.dtype), device)
             for w in wants])
    return _EXPECTED[key]


def _row_errors(got: np.ndarray, out: _Output) -> tuple[np.ndarray, np.ndarray]:
    """(largest, summed) |got - want| of each row (NaN where got is NaN at a finite reference).
    Compared in cache-sized chunks over threads: whole-array numpy expressions spill every
    temporary to memory and dominate a large candidate's check."""
    rows, width = out.want.shape
    if not rows:
        return np.zeros(0, "float32"), np.zeros(0, "float32")
    step = max(1, CHECK_CHUNK // width)

    def errors(start: int) -> tuple:
        part = got[start:start + step].astype("float32")
        np.subtract(part, out.want[start:start + step], out=part)
        np.abs(part, out=part)
        return part.max(-1, initial=0), part.sum(-1)

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(errors, range(0, rows, step)))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _mismatch(got: np.ndarray, out: _Output) -> str | None:
    """What is wrong with `got` as output `out`, or None when it is within the bounds."""
    got = got.reshape(out.want.shape)
    if out.special.size:  # NaN where the reference has NaN, the same infinity where it has one
        there = got.reshape(-1)[out.special].astype("float32")
        same = (np.isnan(there) & np.isnan(out.special_want)) | (there == out.special_want)
        if not same.all():
            i = int(np.argmin(same))
            return f"element {int(out.special[i])} is {there[i]} where the reference has {out.special_want[i]}"
        got = got.copy()
        got.reshape(-1)[out.special] = 0
    largest, summed = _row_errors(got, out)
    where = f"of {len(largest)} rows of {out.want.shape[1]}" if len(largest) > 1 else "(one row: the whole tensor)"
    bad = np.flatnonzero(~(largest <= out.element_bound))
    if bad.size:
        r = int(bad[0])
        return (f"row {r} {where}: an element is off by {largest[r]:.3g}, more than {out.element_bound[r]:.3g} "
                f"({tolerances(out.dtype)[0]:.3g} of the row's largest |value|); {bad.size} row(s) so")
    bad = np.flatnonzero(~(summed <= out.mass_bound))
    if bad.size:
        r = int(bad[0])
        return (f"row {r} {where}: errors sum to {summed[r]:.3g}, more than {out.mass_bound[r]:.3g} "
                f"({tolerances(out.dtype)[1]:.3g} of the row's summed |value|); {bad.size} row(s) so")
    return None


def check_outputs(got: list, outputs: list) -> None:
    """Raise unless every output is within its bounds (see output_bounds), naming the first that is not."""
    for i, (value, out) in enumerate(zip(got, outputs, strict=True)):
        problem = _mismatch(value, out)
        if problem:
            raise ValueError(f"wrong result: output {i} ({out.name}, {out.dtype}): {problem}")


def _l2_flusher(target, device):
    """The name of a global function that evicts the GPU's L2 by launching a copy kernel larger than
    it. A kernel, not a runtime copy: it is queued without waiting, so the timed call that follows
    starts the moment it ends and the timer sees no launch gap."""
    name = "tvm_ext.search.flush_l2"
    if tvm.get_global_func(name, allow_missing=True) is None:
        a = te.placeholder((FLUSH_BYTES // 4,), "float32", name="a")
        sch = tvm.s_tir.Schedule(te.create_prim_func([a, te.compute(a.shape, lambda i: a[i] + 1.0, name="b")]))
        blocks, threads = sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 256])
        sch.bind(blocks, "blockIdx.x")
        sch.bind(threads, "threadIdx.x")
        kernel = tvm.compile(sch.mod, target=target)
        src, dst = (tvm.runtime.empty(a.shape, "float32", device) for _ in range(2))

        def flush(*_args) -> None:  # returns nothing: the timer's C++ caller takes no object back
            kernel["main"](src, dst)
        tvm.register_global_func(name, flush, override=True)
    return name


def run_candidate(func_json: str, target_json: str, dims: dict, scratch: str, lib_path: str, zeroed: list,
                  repeat: int = REPEAT) -> list[float]:
    """In the runner: load a built candidate, check its output against the reference, time it (us)."""
    target = tvm.target.Target(target_json)
    device = _device(target)
    expected = _expected(func_json, dims, device, scratch)
    lib = tvm.runtime.load_module(lib_path)
    outs = [tvm.runtime.empty(p.shape, p.dtype, device) for p in expected.poison]
    for poison, out in zip(expected.poison, outs):
        poison.copyto(out)  # a candidate that skips an element cannot pass
    zeros = [tvm.runtime.tensor(np.zeros(shape, zdtype), device) for shape, zdtype in zeroed]
    args = expected.inputs + zeros + outs
    lib["main"](*args)
    check_outputs([out.numpy() for out in outs], expected.outputs)
    if target.kind.name == "llvm":
        timer = lib.time_evaluator("main", device, number=10, repeat=max(3, repeat // 4))
    else:
        timer = lib.time_evaluator("main", device, number=1, repeat=repeat, f_preproc=_l2_flusher(target, device))
    return [t * 1e6 for t in timer(*args).results]


def copy_gbps(target_json: str) -> float:
    """The device's copy bandwidth (bytes read + written per second / 1e9), the yardstick of the tables."""
    target = tvm.target.Target(target_json)
    device = _device(target)
    size = 1 << 26 if target.kind.name == "llvm" else 1 << 30
    src, dst = tvm.runtime.empty((size,), "uint8", device), tvm.runtime.empty((size,), "uint8", device)
    best = float("inf")
    for _ in range(10):
        device.sync()
        start = time.perf_counter()
        src.copyto(dst)
        device.sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size / best / 1e9


# ---- isolated workers ----------------------------------------------------------------------

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


class _Worker:
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


class _Pool:
    """Up to `size` workers taking submitted jobs in order; a worker whose job failed is replaced
    before it takes another. With `spare`, one more worker is kept started so that a replacement
    does not wait for TVM's import."""

    def __init__(self, size: int, spare: bool = False):
        self.context, self.size, self.spare = mp.get_context("spawn"), size, spare
        self.workers: list = []
        self.reserve = None
        self.pending: deque = deque()  # (job id, fn, args, timeout) not started yet
        self.busy: dict = {}  # worker -> timeout of its job

    def _fresh(self) -> _Worker:
        worker, self.reserve = self.reserve or _Worker(self.context), None
        if self.spare:
            self.reserve = _Worker(self.context)
        return worker

    def warm(self) -> None:
        """Start every worker now, so that TVM's import overlaps with the caller's own work."""
        while len(self.workers) < self.size:
            self.workers.append(self._fresh())

    def submit(self, job_id, fn, args, timeout: float) -> None:
        self.pending.append((job_id, fn, args, timeout))

    @property
    def idle(self) -> bool:
        return not self.pending and not self.busy

    def poll(self) -> list:
        """Start pending jobs on free workers; (job id, (status, value)) of each job that has ended."""
        while self.pending and len(self.workers) < self.size and len(self.busy) == len(self.workers):
            self.workers.append(self._fresh())
        for worker in [w for w in self.workers if w not in self.busy]:
            if not self.pending:
                break
            job_id, fn, args, timeout = self.pending.popleft()
            worker.submit(job_id, fn, args)
            self.busy[worker] = timeout
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
        return ended

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


class Measurer:
    """Builds in parallel and runs one candidate at a time, each as soon as it is built; keeps its
    workers across calls (one tuning run) and starts them when created."""

    def __init__(self, target, builders: int | None = None, timeout: float = 60.0,
                 builder=build_candidate, runner=run_candidate):
        self.target_json, self.timeout = str(target), timeout
        self.overlap = tvm.target.Target(self.target_json).kind.name != "llvm"  # CPU timings would feel builds
        self.builder, self.runner = builder, runner
        self.builders = _Pool(builders or min(8, os.cpu_count() or 1))
        self.runners = _Pool(1, spare=True)
        self.scratch = tempfile.TemporaryDirectory(prefix="tvm_ext_measure_")
        self.seconds = {"measure": 0.0, "run": 0.0}  # wall time measuring, and of it the runner's busy time
        self.runners.warm()
        self.builders.warm()

    def measure(self, func, candidates: list[dict], dims: dict | None = None, on_result=None) -> list[Result]:
        """One Result per candidate, in order; `on_result(i, result)` is called as candidate i finishes."""
        func_json, dims = tvm.ir.save_json(func), dict(dims or {})
        started, libs = time.monotonic(), []
        for i, knobs in enumerate(candidates):
            self.builders.submit(i, self.builder, (func_json, self.target_json, knobs, self.scratch.name), self.timeout)
        outcome, built, last = {}, [], started
        while not (self.builders.idle and self.runners.idle and not built):
            finished = []
            for i, answer in self.builders.poll():
                if answer[0] == "ok":
                    built.append((i, answer[1]))
                else:
                    finished.append((i, answer))
            if self.overlap or self.builders.idle:  # a GPU candidate runs while the others still build
                for i, (lib, zeroed) in built:
                    libs.append(lib)
                    self.runners.submit(i, self.runner, (func_json, self.target_json, dims, self.scratch.name, lib,
                                                         zeroed), self.timeout)
                built = []
            running = not self.runners.idle
            for i, answer in finished + self.runners.poll():
                outcome[i] = answer
                if on_result is not None:
                    on_result(i, _result(candidates[i], answer))
            time.sleep(POLL_S)
            now = time.monotonic()
            self.seconds["run"] += (now - last) if running else 0.0
            last = now
        for lib in libs:
            os.unlink(lib)
        self.seconds["measure"] += time.monotonic() - started
        return [_result(knobs, outcome[i]) for i, knobs in enumerate(candidates)]

    def time_library(self, func, lib_path: str, dims: dict | None = None) -> Result:
        """Check and time a library built elsewhere (e.g. by MetaSchedule) for `func`, exactly as
        candidates are: same runner, reference, timer."""
        (answer,) = self.runners.map(self.runner, [(tvm.ir.save_json(func), self.target_json, dict(dims or {}),
                                                    self.scratch.name, lib_path, [])], self.timeout)
        return _result({}, answer)

    def copy_gbps(self) -> float:
        """The device's copy bandwidth, the report's yardstick (not a candidate: the tuner's --timeout
        does not bound it, COPY_TIMEOUT_S does)."""
        (status, value), = self.runners.map(copy_gbps, [(self.target_json,)], COPY_TIMEOUT_S)
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
