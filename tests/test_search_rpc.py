"""Measurement on TVM's RPC servers (search/rpc.py): a tracker and two llvm servers on 127.0.0.1,
started here and stopped at the end. Candidates are checked and timed there, a wrong one is an
error, a server killed mid-run costs at most the candidate it ran, and the command line refuses a
tracker that is not there in one line."""

import os
import re
import time

import numpy as np
import pytest
import tvm

from tvm_ext.search.local_cluster import START_S, free_port, local_cluster, start, stop, wait_for
from tvm_ext.search.measure import Measurer
from tvm_ext.search.rpc import registered_servers
from tvm_ext.search.space import knob_space
from test_search_measure import CPU_ROWS, TARGET, task, zeroing_builder

KEY = "tvm-ext-test-llvm"


@pytest.fixture()
def servers():
    """(tracker address, [server processes]): a tracker and two servers under KEY, all stopped after."""
    with local_cluster(2, KEY) as cluster:
        yield cluster


def test_candidates_are_checked_and_timed_on_two_servers(servers):
    tracker, _ = servers
    t = task()
    with Measurer(TARGET, builders=2, timeout=120, rpc=(tracker, KEY)) as measurer:
        assert len(measurer.runners.workers) == 2, "a runner per free server"
        candidates = knob_space(t.func, TARGET)[:4]
        results = measurer.measure(t.func, candidates)
        assert len(candidates) >= 2 and [r.error for r in results] == [None] * len(candidates)
        assert all(len(r.us) >= 3 and 0 < r.best_us < 1e5 for r in results)
        measurer.builder = zeroing_builder
        (wrong,) = measurer.measure(t.func, [CPU_ROWS])
        assert wrong.us == [] and wrong.error.startswith("ValueError: wrong result"), wrong.error
        assert measurer.copy_gbps() > 0


def test_a_server_killed_mid_run_costs_at_most_the_candidate_it_ran(servers):
    tracker, procs = servers
    t = task()
    candidates = (knob_space(t.func, TARGET) * 2)[:6]
    with Measurer(TARGET, builders=2, timeout=120, rpc=(tracker, KEY)) as measurer:
        killed = []

        def kill_one(_i, _result):
            if not killed:
                stop(procs[0])
                killed.append(True)
        results = measurer.measure(t.func, candidates, on_result=kill_one)
    assert killed
    errors = [r.error for r in results if r.error is not None]
    assert len(errors) <= 1, errors
    assert sum(r.error is None and r.best_us > 0 for r in results) >= len(candidates) - 1


def test_the_command_line_refuses_a_tracker_that_is_not_there(tmp_path):
    from test_cli import _run  # noqa: PLC0415

    done = _run("scripts/tune.py", "--model", "suite:rms-8192x4096-bf16", "--target", "llvm", "--trials", "2",
                "--log", str(tmp_path / "t.json"), "--rpc-tracker", f"127.0.0.1:{free_port()}", "--rpc-key", KEY)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("tune.py: no RPC tracker answers at 127.0.0.1:")
    done = _run("scripts/tune.py", "--model", "suite:rms-8192x4096-bf16", "--target", "llvm", "--trials", "2",
                "--log", str(tmp_path / "t.json"), "--rpc-key", KEY)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "tune.py: --rpc-tracker and --rpc-key go together: the tracker's address and the servers' key"


class _NoDownload:
    """An output that fails the test if it is brought here whole."""

    def __init__(self, tensor):
        self.tensor = tensor

    def _create_view(self, shape):
        return self.tensor._create_view(shape)

    def numpy(self):
        raise AssertionError("the output was downloaded")


def test_outputs_are_checked_on_the_server_and_only_brought_here_when_wrong(tmp_path, rng):
    """On a session standing in for a server: the poisoned output is written there (NaN); right
    fp16 norm rows pass with two numbers a row brought back; a row 14% off, one NaN, or a reference
    with an infinity (checked here) take the exact check's path and message."""
    from tvm import rpc  # noqa: PLC0415

    from tvm_ext.search.check import output_bounds  # noqa: PLC0415
    from tvm_ext.search.remote_check import check_remote, on_server  # noqa: PLC0415
    from tvm_ext.search.runner import Expected  # noqa: PLC0415

    session = rpc.LocalSession()
    device = session.cpu()

    def expecting(want):
        expected = Expected([], [], [output_bounds(want, "float16", "y")], [tvm.runtime.tensor(np.zeros_like(want))])
        _, poison, there = on_server(expected, session, device, TARGET, str(tmp_path))
        assert poison[0].shape == want.shape and np.isnan(poison[0].numpy()).all()
        return expected.outputs, there

    def check(got, expected):
        check_remote([got], expected[1], expected[0], session, device, TARGET, str(tmp_path))

    long_rows = rng.standard_normal((3, 8192)).astype("float16")  # measured in 8 pieces a row
    check(_NoDownload(tvm.runtime.tensor(long_rows, device)), expecting(long_rows))
    wrong = long_rows.copy()
    wrong[2, 8000] += 1.0
    with pytest.raises(ValueError, match="row 2 of 3 rows"):
        check(tvm.runtime.tensor(wrong, device), expecting(long_rows))
    want = rng.standard_normal((4, 16, 1000)).astype("float16")
    expected = expecting(want)
    check(_NoDownload(tvm.runtime.tensor(want, device)), expected)
    wrong = want.copy()
    wrong[1, 5] *= 1.14
    with pytest.raises(ValueError, match="wrong result: output 0 \\(y, float16\\): row 21 of 64 rows"):
        check(tvm.runtime.tensor(wrong, device), expected)
    wrong = want.copy()
    wrong[0, 7, 3] = np.nan
    with pytest.raises(ValueError, match="row 7 of 64 rows"):
        check(tvm.runtime.tensor(wrong, device), expected)
    special = want.copy()
    special[0, 1, 1] = np.inf
    expected = expecting(special)
    assert expected[1] == [None]
    with pytest.raises(AssertionError, match="downloaded"):  # an infinity where the reference has one: checked here
        check(_NoDownload(tvm.runtime.tensor(special, device)), expected)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32"])
def test_the_servers_check_and_poison_kernels_build_for_cuda_and_poison_as_the_runner(dtype):
    """The kernels remote_check builds for a CUDA server (a seeded-input one for floating point)
    compile with nvcc (a bfloat16 NaN written as a constant did not), and the poison is
    runner.poison_value."""
    import shutil  # noqa: PLC0415

    from tvm.support import nvcc  # noqa: PLC0415

    import tvm_ext  # noqa: PLC0415
    from tvm_ext.search.remote_check import server_module  # noqa: PLC0415
    from tvm_ext.search.runner import poison_value  # noqa: PLC0415

    cuda = tvm_ext.parse_target({"tag": "nvidia/nvidia-h100", "arch": "sm_90a"})
    src = tvm_ext.cuda_source(tvm.compile(server_module(dtype, cuda), target=cuda))
    kernels = {"largest_kernel", "summed_kernel", "poison_kernel"} | ({"seeded_kernel"} if "float" in dtype else set())
    assert kernels == set(re.findall(r"\w+_kernel", src)) & (kernels | {"seeded_kernel"})
    if shutil.which("nvcc"):
        with cuda:
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"
    out = tvm.runtime.empty((7,), dtype)
    tvm.compile(server_module(dtype, TARGET), target=TARGET)["poison"](out)
    np.testing.assert_array_equal(out.numpy().astype("float32"), np.full(7, poison_value(dtype), "float32"))


class _NotSent:
    """A task input that fails the test if it is read here to be sent."""

    def __init__(self, tensor):
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def numpy(self):
        raise AssertionError("the input was sent")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_seeded_inputs_are_made_on_the_server_bit_for_bit(tmp_path, dtype):
    """A task's seeded inputs are made by the server's kernel, never sent, with check.seeded's bits
    (the reference was computed here on those); an integer input (zeros) is sent."""
    from tvm import rpc  # noqa: PLC0415

    from tvm_ext.search.check import input_seeds, seeded  # noqa: PLC0415
    from tvm_ext.search.remote_check import on_server  # noqa: PLC0415
    from tvm_ext.search.runner import Expected  # noqa: PLC0415

    x, w = tvm.te.placeholder((37, 301), dtype, "x"), tvm.te.placeholder((301,), dtype, "w")
    index = tvm.te.placeholder((37,), "int32", "index")
    y = tvm.te.compute((37, 301), lambda i, j: x[i, j] * w[j] + index[i].astype(dtype), "y")
    func = tvm.te.create_prim_func([x, w, index, y])
    assert input_seeds(func) == [0, 1, None]
    arrays = [seeded((37, 301), dtype, 0), seeded((301,), dtype, 1), np.arange(37, dtype="int32")]
    assert not np.array_equal(arrays[0][0], arrays[1])  # each input its own values
    session = rpc.LocalSession()
    device = session.cpu()
    local = [_NotSent(a) for a in arrays[:2]] + [tvm.runtime.tensor(arrays[2])]
    inputs, _, _ = on_server(Expected(local, input_seeds(func), [], []), session, device, TARGET, str(tmp_path))
    for made, want in zip(inputs, arrays):
        assert made.dtype == str(want.dtype) and np.array_equal(made.numpy().view(np.uint8), want.view(np.uint8))


def test_the_throughput_bench_gives_each_server_whole_cores_of_its_own(tmp_path):
    """bench.rpc_throughput pins each llvm server to whole physical cores (hyperthread siblings
    together), so that no two servers, nor a server and a builder, share a core."""
    from bench.rpc_throughput import pin  # noqa: PLC0415

    for cpu in range(8):  # 4 cores of 2 threads, siblings numbered cpu and cpu + 4
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    assert pin(list(range(8)), 2, 2, str(tmp_path)) == ([[0, 4], [1, 5]], [2, 6, 3, 7])
    assert pin(list(range(8)), 1, 3, str(tmp_path)) == ([[0, 4, 1, 5]], [2, 6, 3, 7])  # whole cores: 4 CPUs
    assert pin([0, 1, 2], 1, 1, str(tmp_path / "none")) == ([[0]], [1, 2])  # no topology: a CPU a core


PROBE = '''
import os, sys
import numpy as np
import tvm
from tvm.script import tirx as T

@T.prim_func
def add_one(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "float32")):
    for i in T.parallel(4096):
        b[i] = a[i] + T.float32(1)

lib = tvm.compile(add_one, target="llvm")
a = tvm.runtime.tensor(np.zeros(4096, "float32"))
b = tvm.runtime.tensor(np.zeros(4096, "float32"))
lib(a, b)
allowed = set()
for tid in os.listdir("/proc/self/task"):
    allowed |= os.sched_getaffinity(int(tid))
with open(sys.argv[1], "w") as f:
    f.write(",".join(map(str, sorted(allowed))))
'''


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin a process to one of them")
def test_a_pinned_process_keeps_tvm_threads_on_its_cpus(tmp_path):
    """TVM's thread pool binds its threads to the machine's first CPUs unless told not to: a
    server pinned by local_cluster.start keeps every thread on its own CPUs."""
    (tmp_path / "probe.py").write_text(PROBE)
    cpu = max(os.sched_getaffinity(0))
    proc = start("probe", str(tmp_path / "out"), env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}",
                                                   "TVM_NUM_THREADS": "2"}, cpus=[cpu])
    assert proc.wait(timeout=120) == 0
    assert (tmp_path / "out").read_text() == str(cpu)


def test_a_server_that_cannot_start_is_named_with_its_error_at_once(tmp_path):
    # a server whose Python finds a `tvm` that fails to import (as TVM's RPC does without tornado)
    (tmp_path / "tvm").mkdir()
    (tmp_path / "tvm" / "__init__.py").write_text('raise ImportError("no module named tornado (test)")\n')
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tvm\.exec\.rpc_server exited with code 1: ImportError: no module named tornado"):
        with local_cluster(1, KEY, env={"PYTHONPATH": str(tmp_path)}):
            pass
    assert time.monotonic() - started < START_S / 2, "not after the registration wait"


def test_a_runner_waits_for_a_busy_server_only_while_one_is_not_held_by_another_runner(servers):
    # each runner keeps its server for the run: once server 0 is gone, the one left is held by the
    # other runner, so a runner finding no server free has lost its own (it leaves the pool at once),
    # not found one busy finishing an overrun candidate (which it waits for, BUSY_RETRIES times
    # SERVER_WAIT_S)
    tracker, procs = servers
    with Measurer(TARGET, builders=1, timeout=120, rpc=(tracker, KEY)) as measurer:
        assert measurer.runners.size == 2 and registered_servers(tracker, KEY) == 2
        assert measurer._server_left_over()
        stop(procs[0])
        wait_for(lambda: registered_servers(tracker, KEY) == 1, "the tracker dropping the killed server", 30)
        assert not measurer._server_left_over()
    assert registered_servers(f"127.0.0.1:{free_port()}", KEY) == 0  # no tracker there
