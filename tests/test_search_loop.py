"""The whole loop on the CPU: extract -> search a few trials on llvm -> log -> build from the log -> right answer."""

import json

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from tvm_ext.schedules import contraction_template
from tvm_ext.search.measure import Result
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.tuner import model_path, tune_model
from tvm_ext.records import Database, append_record

TARGET = tvm_ext.parse_target("llvm")


def test_tune_log_build_run(tmp_path, rng):
    mod = relax_module("softmax", [64, 300], "float32")
    (task,) = extract_tasks(mod, TARGET)
    log = tmp_path / "softmax.json"
    (report,) = tune_model(mod, TARGET, trials=3, log=str(log), batch=2, progress=False, timeout=120)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == report.trials == 3 and all(line["key"] == task.key for line in lines)
    assert len({json.dumps(line["knobs"], sort_keys=True) for line in lines}) == 3  # no point measured twice
    good = [line for line in lines if line.get("error") is None]
    best = min(good, key=lambda line: line["us"])
    assert report.best_us == pytest.approx(best["us"]) and report.knobs == best["knobs"]
    assert report.heuristic_us is not None and report.speedup >= 1.0  # the default is always measured
    assert 0 < report.copy_fraction and report.gbps > 0
    assert Database.load(log).lookup(task.func, TARGET) == best["knobs"]
    assert (tmp_path / "softmax.model.json").is_file() and model_path(str(log)) == str(tmp_path / "softmax.model.json")
    x = rng.standard_normal((64, 300)).astype("float32")
    vm = VirtualMachine(tvm_ext.build(mod, TARGET, database=str(log)), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(),
                               np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-5)


def test_failed_measurements_stay_in_the_log_but_are_never_the_best(tmp_path):
    (task,) = extract_tasks(relax_module("softmax", [64, 300], "float32"), TARGET)
    log = tmp_path / "log.json"
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 16}, None, "timed out")
    append_record(log, task.func, TARGET, task.name, {"strategy": "cpu_rows", "lanes": 64}, 12.5, samples=[12.5, 13])
    assert Result({}, [], "x").best_us == float("inf")
    assert Database.load(log).lookup(task.func, TARGET) == {"strategy": "cpu_rows", "lanes": 64}


def test_an_existing_log_is_never_overwritten_and_bad_arguments_are_named(tmp_path):
    mod = relax_module("softmax", [64, 300], "float32")
    log = tmp_path / "kept.json"
    log.write_text("precious\n")
    with pytest.raises(FileExistsError, match="kept.json' already exists: resume it"):
        tune_model(mod, TARGET, trials=2, log=str(log), progress=False)
    assert log.read_text() == "precious\n"
    with pytest.raises(FileNotFoundError, match="cannot resume: tuning log .*missing.json"):
        tune_model(mod, TARGET, trials=2, log=str(tmp_path / "missing.json"), resume=True, progress=False)
    with pytest.raises(ValueError, match="trials must be >= 0"):
        tune_model(mod, TARGET, trials=-1, log=str(tmp_path / "new.json"), progress=False)
    with pytest.raises(ValueError, match="dims seq name no symbolic dim of the model's tasks; theirs: none"):
        tune_model(mod, TARGET, trials=2, log=str(tmp_path / "new.json"), dims={"seq": 512}, progress=False)
    assert not (tmp_path / "new.json").exists()


def test_a_symbolic_task_is_measured_and_reported_at_its_dims(tmp_path):
    """Every record of a task over a symbolic row count says the sizes it was measured at, and the
    run's table says them too (a build for any size has no one size to report otherwise)."""
    from tvm_ext.records import read_records  # noqa: PLC0415
    from tvm_ext.search.cli import table  # noqa: PLC0415

    log = tmp_path / "log.json"
    (report,) = tune_model(relax_module("softmax", ["n", 300], "float32"), TARGET, trials=2, log=str(log),
                           dims={"n": 64}, batch=2, progress=False, timeout=120)
    assert report.sizes == {"n": 64} and [rec["dims"] for rec in read_records(log)] == [{"n": 64}] * 2
    assert f"| {report.name} | n=64 | 1 | 2 |" in table([report])


def _linear_bias(m, n, k):
    """A fp16 Linear with its bias, as FuseOps leaves it: a tensor-core matmul task on a GPU."""
    from tvm import relax  # noqa: PLC0415

    from bench.spelled import main_module  # noqa: PLC0415

    a, w = relax.Var("a", relax.TensorType([m, k], "float16")), relax.Var("w", relax.TensorType([k, n], "float16"))
    bias = relax.Var("bias", relax.TensorType([n], "float16"))
    return main_module(lambda bb, a, w, bias: relax.op.add(
        relax.op.astype(relax.op.matmul(a, w, out_dtype="float32"), "float16"), bias), [a, w, bias])


def test_a_tensor_core_matmul_is_a_task_on_a_gpu_with_the_template_tilings_as_its_space():
    from conftest import CUDA_TARGET  # noqa: PLC0415
    from tvm_ext.schedules import matmul  # noqa: PLC0415
    from tvm_ext.search.features import NAMES, candidate_features  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415

    mod, cuda = _linear_bias(2048, 1024, 512), tvm_ext.parse_target(CUDA_TARGET)
    assert extract_tasks(mod, TARGET) == []  # on the CPU matmuls stay TVM's
    (task,) = extract_tasks(mod, cuda)
    points = knob_space(task.func, cuda)
    assert len(points) >= 5 and {p["strategy"] for p in points} == {"matmul"}
    assert points[0] == matmul.heuristic(task.func, 132)[0]  # the heuristic's point first
    x = candidate_features(task.func, points, cuda)
    column = dict(zip(NAMES, x.T))
    assert (column["is_matmul"] == 1).all() and (column["is_warp_row"] == 0).all()
    assert set(column["pipeline_stages"]) == {p["stages"] for p in points} and len(set(column["waves"])) > 1


@pytest.mark.gpu
def test_a_matmul_tunes_and_builds_from_its_log(tmp_path, rng):
    mod, cuda, log = _linear_bias(1024, 1024, 512), tvm_ext.parse_target("cuda"), tmp_path / "mm.json"
    (report,) = tune_model(mod, cuda, trials=6, log=str(log), batch=3, progress=False, timeout=300)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    (task,) = extract_tasks(mod, cuda)
    template = contraction_template(task.func, cuda).NAME  # wgmma on an sm_90a GPU (an H100/H200)
    assert len(lines) == 6 and all(line["knobs"]["strategy"] == template and line.get("error") is None for line in lines)
    assert Database.load(log).lookup(task.func, cuda) == report.knobs
    a, w, b = (rng.integers(-3, 4, s).astype("float16") for s in ([1024, 512], [512, 1024], [1024]))
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(mod, cuda, database=str(log)), dev)["main"](
        *[tvm.runtime.tensor(x, dev) for x in (a, w, b)]).numpy()
    np.testing.assert_array_equal(out, (a.astype("float32") @ w.astype("float32") + b).astype("float16"))


def _attention_task(packed=False, mask=None):
    """The fused attention kernel of a spelled-out chain (tests/test_attention.py's) as a task on sm_90a."""
    from test_attention import SM_90A, spelled  # noqa: PLC0415

    mod = spelled(batch=2, heads=3, seq=128, dim=64, packed=packed, mask=mask)
    (task,) = [t for t in extract_tasks(mod, SM_90A) if t.name == "fused_attention"]
    return mod, task, SM_90A


def test_the_fused_attention_kernel_is_a_task_with_its_tiles_as_its_space():
    from tvm_ext.schedules import attention  # noqa: PLC0415
    from tvm_ext.schedules.dispatch import knobs_problem  # noqa: PLC0415
    from tvm_ext.search.features import NAMES, candidate_features  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415

    mod, task, sm90a = _attention_task(packed=True)
    points = knob_space(task.func, sm90a)
    assert points[0] == attention.DEFAULT_KNOBS and len(points) == 4  # 1 or 2 warpgroups, 64- or 128-key tiles
    assert all(knobs_problem(task.func, sm90a, p) is None for p in points)
    column = dict(zip(NAMES, candidate_features(task.func, points, sm90a).T))
    assert list(column["threads"]) == [128, 128, 256, 256] and list(column["log2_k_per_step"]) == [6, 7, 6, 7]
    assert len(set(column["staged_bytes_per_block"])) == 4 and (column["is_matmul"] == 1).all()


@pytest.mark.parametrize("knobs, key_tile, threads", [(None, 64, 128), ({"warpgroups": 2, "block_n": 128}, 128, 256)])
def test_a_logged_attention_point_remakes_the_kernel(tmp_path, knobs, key_tile, threads):
    """The build takes the log's point for the attention task (the kernel made again at it); without a
    record the kernel stays as written, at the default point."""
    from tvm_ext.introspect import cuda_source  # noqa: PLC0415

    mod, task, sm90a = _attention_task()
    log = tmp_path / "attention.json"
    append_record(log, task.func, sm90a, task.name, {"strategy": "attention", **(knobs or {"warpgroups": 1, "block_n": 64})}, 9.0)
    if knobs is None:
        log.write_text("")
    src = cuda_source(tvm_ext.build(mod, sm90a, database=str(log) if knobs else None))
    assert f"wgmma.mma_async.sync.aligned.m64n{key_tile}k16.f32.f16.f16" in src  # S: a tile of keys
    assert f"__launch_bounds__({threads}) fused_attention" in src


def test_the_attention_reference_reads_and_writes_through_the_kernels_views(tmp_path):
    """The check's CPU reference of a packed, masked attention task (q, k and v read from one [b, s, 3
    * heads * dim] tensor each, the heads merged into rows) against float64 numpy on its inputs."""
    from tvm_ext.search.check import reference_arrays  # noqa: PLC0415

    b, s, h, d = 2, 128, 3, 64
    mask = np.where(np.arange(s)[None, :] > np.arange(s)[:, None] + 7, -1e4, 0.5).astype("float32")
    _, task, _ = _attention_task(packed=True, mask=mask)
    (q, k, v, *rest, out), _ = reference_arrays(task.func, {}, str(tmp_path / "reference.npz"))
    heads = lambda x, i: x.astype("float64").reshape(b, s, 3, h, d).transpose(2, 0, 3, 1, 4)[i]  # noqa: E731
    scores = heads(q, 0) @ heads(k, 1).transpose(0, 1, 3, 2) / 8 + (rest[0].astype("float64") if rest else mask.astype("float16"))
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True) @ heads(v, 2)).transpose(0, 2, 1, 3).reshape(b, s, h * d)
    assert out.shape == (b, s, h * d) and np.abs(out.astype("float64") - want).max() < 2e-3


@pytest.mark.gpu
def test_the_attention_task_tunes_and_builds_from_its_log(tmp_path, rng):
    """Every point of the attention task measured (each checked against the reference), and the
    build from the log right against float64."""
    mod, task, _ = _attention_task()
    cuda, log = tvm_ext.parse_target("cuda"), tmp_path / "attention.json"
    reports = tune_model(mod, cuda, trials=4, log=str(log), batch=4, progress=False, timeout=300)
    lines = [json.loads(line) for line in log.read_text().splitlines() if json.loads(line)["task"] == task.name]
    assert len(lines) == 4 and all(line.get("error") is None for line in lines)
    assert {json.dumps(line["knobs"], sort_keys=True) for line in lines} == {
        json.dumps({"strategy": "attention", "warpgroups": w, "block_n": n}, sort_keys=True) for w in (1, 2) for n in (64, 128)}
    report = next(r for r in reports if r.name == task.name)
    assert Database.load(log).lookup(task.func, cuda) == report.knobs
    q, k, v = (rng.standard_normal((2, 3, 128, 64)).astype("float16") for _ in range(3))
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(mod, cuda, database=str(log)), dev)["main"](
        *[tvm.runtime.tensor(x, dev) for x in (q, k, v)]).numpy()
    s = q.astype("float64").reshape(6, 128, 64) @ k.astype("float64").reshape(6, 128, 64).transpose(0, 2, 1) / 8
    p = np.exp(s - s.max(-1, keepdims=True))
    want = p / p.sum(-1, keepdims=True) @ v.astype("float64").reshape(6, 128, 64)
    assert np.abs(out.astype("float64").reshape(6, 128, 64) - want).max() < 2e-3
