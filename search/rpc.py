"""Measurement on TVM's RPC servers: candidates built here are uploaded to the servers a tracker
hands out (`python -m tvm.exec.rpc_tracker`, `python -m tvm.exec.rpc_server --tracker HOST:PORT
--key KEY`), checked there against the reference and timed, as the local runner does.

There is one runner per free server at the start. Each runner asks the tracker for a server on its
first job and keeps that connection for the run (a server starts a process, and a CUDA context, per
connection: seconds with --no-fork, which CUDA servers need), with a task's inputs and reference
uploaded once and kept there while the last tasks fit (runner.Kept), and each candidate's outputs
checked there (remote_check).
A candidate that fails, hangs or loses its server costs that trial and its runner, whose successor
connects again; where no server comes free within SERVER_WAIT_S, the server is gone: the pool
runs one runner fewer and the candidate goes to another (NoServerError). The reference is computed
here once per task."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import tvm
from tvm import rpc

from .remote_check import check_remote, on_server
from .runner import REPEAT, Kept, check_and_time, device_copy_gbps, expected, poisoned, reference_path

CONNECT_TIMEOUT_S = 5.0
SERVER_WAIT_S = 10.0  # a runner waits this long for a free server before it counts one as gone


class NoServerError(RuntimeError):
    """No server of the key came free in time: a failure of the machinery, not of the candidate."""


class ServerBusyError(NoServerError):
    """No server came free in time, but one is still registered: busy finishing a candidate whose
    runner was stopped for overrunning its timeout (its kernel runs on; the server frees when it ends)."""


def parse_tracker(text: str) -> tuple[str, int]:
    """HOST:PORT of a tracker, refused in one line otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rpc-tracker {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9190")
    return host, int(port)


def free_servers(tracker: str, key: str) -> int:
    """Free servers registered with `tracker` under `key`; raises ValueError naming what is missing
    where the tracker does not answer or has none."""
    host, port = parse_tracker(tracker)
    try:  # TVM's client retries for a minute: a tracker that is not there is told at once
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        summary = rpc.connect_tracker(host, port).summary()
    except (OSError, RuntimeError) as err:
        raise ValueError(f"no RPC tracker answers at {tracker} ({err})") from None
    queues = summary.get("queue_info", {})
    free = int(queues.get(key, {}).get("free", 0))
    if free <= 0:
        raise ValueError(f"the RPC tracker at {tracker} has no free server under key {key!r}"
                         + (f" (keys: {', '.join(sorted(queues))})" if queues else " (no server registered)"))
    return free


def registered_servers(tracker: str, key: str) -> int:
    """Servers registered with `tracker` under `key`, free or in use (0 where it does not answer)."""
    host, port = parse_tracker(tracker)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        summary = rpc.connect_tracker(host, port).summary()
    except (OSError, RuntimeError):
        return 0
    return sum(info["key"] == f"server:{key}" for info in summary.get("server_info", []))


_CONNECTION: dict = {}  # in a runner: its server connection and its device


def _connection(tracker: str, key: str, target):
    """This runner's (remote, device), connected on its first job and kept for the run."""
    if "remote" not in _CONNECTION:
        host, port = parse_tracker(tracker)
        client = rpc.connect_tracker(host, port)
        deadline = time.monotonic() + SERVER_WAIT_S
        while (summary := client.summary()).get("queue_info", {}).get(key, {}).get("free", 0) <= 0:
            if time.monotonic() > deadline:
                registered = sum(info["key"] == f"server:{key}" for info in summary.get("server_info", []))
                raise (ServerBusyError if registered else NoServerError)(
                    f"no server under key {key!r} came free within {SERVER_WAIT_S:g} s ({registered} registered)")
            time.sleep(0.2)
        remote = client.request(key)  # no time limit of the server's: the pool's bounds each job
        device = _device(remote, target)
        try:
            tvm.runtime.empty((1,), "uint8", device)
        except Exception as err:  # a forked server's process cannot initialise CUDA
            if "InitializationError" in str(err):
                raise RuntimeError(f"the RPC server under key {key!r} cannot initialise CUDA: start CUDA servers "
                                   "with --no-fork (python -m tvm.exec.rpc_server ... --no-fork)") from None
            raise
        _CONNECTION.update(remote=remote, device=device)
    return _CONNECTION["remote"], _CONNECTION["device"]


_ON_SERVER = Kept()  # in a runner: the last tasks' tensors on its server


def _on_server(key: str, want, remote, device, target, scratch: str) -> tuple[list, list, list]:
    """The task's inputs, poisoned outputs and references on the server, made once per task and
    kept while the last tasks fit (runner.Kept)."""
    def make():
        return on_server(want, remote, device, target, scratch)

    def nbytes():
        tensors = want.inputs + want.poison + want.poison  # the references: the outputs' size again
        return sum(int(np.prod(t.shape)) * tvm.DataType(str(t.dtype)).bits // 8 for t in tensors)

    return _ON_SERVER.get(key, make, nbytes)


def _device(remote, target):
    return remote.cpu() if target.kind.name == "llvm" else remote.device(target.kind.name)


def run_candidate_rpc(func_json: str, target_json: str, dims: dict, scratch: str, lib_path: str, zeroed: list,
                      tracker: str, key: str, repeat: int = REPEAT) -> list[float]:
    """In a runner: upload a built candidate to this runner's server, run it there, check its
    output against the reference here, time it there (us)."""
    target = tvm.target.Target(target_json)
    want = expected(func_json, dims, tvm.cpu(), scratch)  # computed here, once per task
    remote, device = _connection(tracker, key, target)
    inputs, poison, references = _on_server(reference_path(func_json, dims, scratch), want, remote, device, target,
                                            scratch)
    name = os.path.basename(lib_path)
    remote.upload(lib_path)

    def check(outs):
        check_remote(outs, references, want.outputs, remote, device, target, scratch)

    try:
        return check_and_time(remote.load_module(name), device, target, inputs, poisoned(poison, device), want,
                              zeroed, repeat, check)
    finally:
        remote.remove(name)


def copy_gbps_rpc(target_json: str, tracker: str, key: str) -> float:
    """A server's copy bandwidth (runner.device_copy_gbps on its device)."""
    target = tvm.target.Target(target_json)
    return device_copy_gbps(_connection(tracker, key, target)[1], target)
