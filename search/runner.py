"""Runner: load a built candidate in the runner process, check its outputs, time it."""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import tvm

from .check import check_outputs, input_seeds, output_bounds, output_count, reference_arrays, task_bytes

REPEAT = 20  # timed calls per candidate on a GPU (each after an L2 flush); CPU: repeats of 10 calls
FLUSH_BYTES = 256 << 20  # twice the largest L2 we target
COPY_TIMEOUT_S = 120.0  # seconds the copy-bandwidth measurement may take


def _device(target):
    return tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name)


@dataclass
class Expected:
    """A task's inputs on the device and what its outputs must be, kept by the runner across candidates."""
    inputs: list
    seeds: list  # per input, the check.seeded seed of its values, or None (zeros)
    outputs: list  # one check.Output per output parameter
    poison: list  # per output, a device tensor of its shape no correct candidate leaves in place


KEPT_BYTES = 4 << 30  # the tasks' tensors a runner keeps, here and on its server


class Kept:
    """What a runner made for the tasks it measured last, newest kept always, older ones while the
    tasks' bytes stay under `budget`: the scheduler returns to a task batch after batch, and making
    its tensors again costs a reference load and an upload (through an RPC socket, seconds a task)."""

    def __init__(self, budget: int = KEPT_BYTES):
        self.budget, self.items = budget, OrderedDict()  # key -> (value, bytes), oldest first

    def get(self, key, make, nbytes):
        """The value kept under `key`, else `make()`, after older values are let go (oldest first)
        until `nbytes()` more fit the budget."""
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key][0]
        size = nbytes()
        while self.items and sum(n for _, n in self.items.values()) + size > self.budget:
            self.items.popitem(last=False)
        self.items[key] = (make(), size)
        return self.items[key][0]


_EXPECTED = Kept()  # in a runner: the last tasks' Expected


def reference_path(func_json: str, dims: dict, scratch: str) -> str:
    """Where a task's inputs and reference outputs are kept for the run."""
    key = hashlib.sha1(f"{func_json}{sorted(dims.items())}".encode()).hexdigest()
    return os.path.join(scratch, f"reference-{key}.npz")


def prepare_reference(func_json: str, dims: dict, scratch: str) -> None:
    """In a builder: compute a task's reference while the other builders build its candidates, so
    that the runner loads it instead of computing it between two runs."""
    reference_arrays(tvm.ir.load_json(func_json), dims, reference_path(func_json, dims, scratch))


def expected(func_json: str, dims: dict, device, scratch: str) -> Expected:
    """The task's Expected, made once per task and kept while the last tasks fit KEPT_BYTES."""
    path = reference_path(func_json, dims, scratch)  # one per task and dims: also the key here

    def make() -> Expected:
        func = tvm.ir.load_json(func_json)
        outputs = output_count(func)
        arrays, in_order = reference_arrays(func, dims, path)
        params, wants = func.params[-outputs:], arrays[-outputs:]
        return Expected(
            [tvm.runtime.tensor(a, device) for a in arrays[:-outputs]], input_seeds(func),
            [output_bounds(w, str(p.ty.dtype), p.name, o) for w, p, o in zip(wants, params, in_order or [None] * outputs)],
            [tvm.runtime.tensor(np.full(w.shape, poison_value(str(w.dtype)), w.dtype), device) for w in wants])

    return _EXPECTED.get(path, make, lambda: task_bytes(tvm.ir.load_json(func_json), dims))


def poison_value(dtype: str) -> float:
    """What a fresh output holds before a candidate runs: NaN, or -7 in an integer output."""
    return np.nan if "float" in dtype else -7


def run_candidate(func_json: str, target_json: str, dims: dict, scratch: str, lib_path: str, zeroed: list,
                  repeat: int = REPEAT) -> list[float]:
    """In the runner: load a built candidate, check its output against the reference, time it (us)."""
    target = tvm.target.Target(target_json)
    device = _device(target)
    want = expected(func_json, dims, device, scratch)
    lib = tvm.runtime.load_module(lib_path)
    return check_and_time(lib, device, target, want.inputs, poisoned(want.poison, device), want, zeroed, repeat)


def poisoned(poison: list, device) -> list:
    """Fresh outputs on `device` holding `poison` (on the same device): a candidate that skips an
    element cannot pass."""
    outs = [tvm.runtime.empty(p.shape, p.dtype, device) for p in poison]
    for p, out in zip(poison, outs):
        p.copyto(out)
    return outs


def check_and_time(lib, device, target, inputs: list, outs: list, want: Expected, zeroed: list,
                   repeat: int, check=None) -> list[float]:
    """Run `lib` on `device` (this machine's or an RPC server's) with `inputs`, zero-filled inputs
    and the poisoned `outs`, check the outputs against `want` (`check(outs)` where given, e.g. on
    the server), then time it (us). On a GPU each timed call follows a copy larger than L2, made by
    TVM's timer itself on whichever machine runs it, so a server times exactly as this machine does."""
    zeros = [tvm.runtime.tensor(np.zeros(shape, zdtype), device) for shape, zdtype in zeroed]
    args = inputs + zeros + outs
    lib["main"](*args)
    if check is not None:
        check(outs)
    else:
        check_outputs([out.numpy() for out in outs], want.outputs)
    if target.kind.name == "llvm":
        timer = lib.time_evaluator("main", device, number=10, repeat=max(3, repeat // 4))
    else:
        timer = lib.time_evaluator("main", device, number=1, repeat=repeat, cache_flush_bytes=FLUSH_BYTES)
    return [t * 1e6 for t in timer(*args).results]


def copy_gbps(target_json: str) -> float:
    """The device's copy bandwidth (bytes read + written per second / 1e9), the yardstick of the tables."""
    target = tvm.target.Target(target_json)
    return device_copy_gbps(_device(target), target)


def device_copy_gbps(device, target) -> float:
    """copy_gbps on `device` (this machine's or an RPC server's: the clock runs here, so a server's
    copies also count one round trip each)."""
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
