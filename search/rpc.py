"""Measurement on TVM's RPC servers: candidates built here are uploaded to the servers a tracker
hands out (`python -m tvm.exec.rpc_tracker`, `python -m tvm.exec.rpc_server --tracker HOST:PORT
--key KEY`), checked there against the reference and timed, as the local runner does.

There is one runner per free server at the start, and each candidate asks the tracker for a server
(waiting in its queue while all are busy), so the runners measure on as many servers at once. A
server that dies costs the candidate it was running; the tracker no longer hands it out. A hung
one is the pool's timeout: the runner is replaced and its connection closed. The reference is
computed here once per task; its inputs are uploaded with each candidate."""

from __future__ import annotations

import os
import socket

import tvm
from tvm import rpc

from .runner import REPEAT, check_and_time, device_copy_gbps, expected

CONNECT_TIMEOUT_S = 5.0


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


def _connect(tracker: str, key: str):
    """A connection to a free server of `key`, waiting in the tracker's queue while all are busy."""
    host, port = parse_tracker(tracker)
    return rpc.connect_tracker(host, port).request(key)  # no time limit of the server's: the pool's bounds each job


def _device(remote, target):
    return remote.cpu() if target.kind.name == "llvm" else remote.device(target.kind.name)


def run_candidate_rpc(func_json: str, target_json: str, dims: dict, scratch: str, lib_path: str, zeroed: list,
                      tracker: str, key: str, repeat: int = REPEAT) -> list[float]:
    """In a runner: upload a built candidate to a server of `key`, run it there, check its output
    against the reference here, time it there (us)."""
    target = tvm.target.Target(target_json)
    want = expected(func_json, dims, tvm.cpu(), scratch)  # computed here, once per task
    remote = _connect(tracker, key)
    device = _device(remote, target)
    name = os.path.basename(lib_path)
    remote.upload(lib_path)
    try:
        upload = lambda arrays: [tvm.runtime.tensor(a.numpy(), device) for a in arrays]  # noqa: E731
        # the poisoned outputs: a candidate that skips an element cannot pass
        return check_and_time(remote.load_module(name), device, target, upload(want.inputs), upload(want.poison),
                              want, zeroed, repeat)
    finally:
        remote.remove(name)


def copy_gbps_rpc(target_json: str, tracker: str, key: str) -> float:
    """A server's copy bandwidth (runner.device_copy_gbps on its device)."""
    target = tvm.target.Target(target_json)
    remote = _connect(tracker, key)
    return device_copy_gbps(_device(remote, target), target)
