"""A TVM RPC tracker and servers on this machine, each in its own process group, all stopped on
exit: what the RPC tests and the throughput bench (bench/rpc_throughput.py) tune through."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .rpc import free_servers

START_S = 90.0  # a server imports TVM before it registers: slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args, env: dict | None = None, cpus: list[int] | None = None) -> subprocess.Popen:
    """`python -m ARGS` in its own process group (a server forks a child per connection), on `cpus`
    where given, with `env` added to the environment. A pinned process's TVM thread pool is told
    not to bind its threads (TVM_BIND_THREADS=0): it would bind them to the machine's first CPUs,
    whatever the process's CPU set, so two pinned servers would run on the same cores."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    env = {**os.environ, **({"TVM_BIND_THREADS": "0"} if cpus else {}), **(env or {})}
    errors = tempfile.TemporaryFile()  # read back if the process exits before it serves (exit_of)
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=errors,
                            start_new_session=True, env=env, preexec_fn=pin)
    proc.errors = errors
    return proc


def exit_of(procs: list[subprocess.Popen]) -> str | None:
    """'MODULE exited with code N: LAST STDERR LINE' for the first of `procs` that has exited; None
    while all run."""
    for proc in procs:
        if proc.poll() is not None:
            proc.errors.seek(0)
            lines = proc.errors.read().decode(errors="replace").strip().splitlines()
            return f"{proc.args[2]} exited with code {proc.returncode}: {lines[-1] if lines else '(no output)'}"
    return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if hasattr(proc, "errors"):
        proc.errors.close()


def wait_for(predicate, what: str, seconds: float = START_S, procs: list[subprocess.Popen] = ()) -> None:
    """Return once `predicate()` holds; RuntimeError at once where one of `procs` exits meanwhile
    (a server that cannot import what it needs), TimeoutError after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (exited := exit_of(procs)) is not None:
            raise RuntimeError(f"waiting for {what}: {exited}")
        try:
            if predicate():
                return
        except ValueError:  # free_servers: no server registered yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} within {seconds:.0f} s")


@contextlib.contextmanager
def local_cluster(servers: int, key: str, env: dict | None = None, cpus: list[list[int]] | None = None):
    """(tracker HOST:PORT, [server processes]): a tracker on 127.0.0.1 and `servers` servers under
    `key`, server i on `cpus[i]` where given; all stopped when the block ends."""
    port = free_port()
    tracker = f"127.0.0.1:{port}"
    procs = [start("tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1))]
    try:
        for i in range(servers):
            server_port = free_port()
            procs.append(start("tvm.exec.rpc_server", "--tracker", tracker, "--key", key, "--host", "127.0.0.1",
                               "--port", str(server_port), "--port-end", str(server_port + 1),
                               env=env, cpus=cpus[i] if cpus else None))
        wait_for(lambda: free_servers(tracker, key) == servers, f"{servers} server(s) registered", procs=procs)
        yield tracker, procs[1:]
    finally:
        for proc in procs:
            stop(proc)
