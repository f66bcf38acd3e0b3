"""Matmuls with a symbolic row count (a sequence length): one build serves every length. Each
class of row counts gets its kernel, chosen at run time by a compare on the host: one row is
our GEMV over the weight as stored (tests/test_gemv.py), up to 16 and 32 the few-row template (tests/test_few_row_matmul.py),
the others our tensor-core templates (wgmma on sm_90a, mma.sync elsewhere) with tiles planned for the
class, their last row of tiles guarded, a block's tile computed once (inlined into every index, the
divisions of a short last group made the kernel 8-15% slower than the static one at 512 rows)."""

import json
import re
import warnings

import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.spelled import main_module
from helpers import kernel_bodies
from tvm_ext.pipeline import ScheduleContractions, fused_module
from tvm_ext.schedules import contraction_kernels, few_row_matmul
from tvm_ext.schedules.dispatch import MATMUL_ROW_CLASSES


def linear(n: int, k: int, dtype: str, residual: bool = True, seed: int = 0, rows: int | None = None):
    """(module of `x @ W^T (+ r)` over x [m, k] with m symbolic (`rows` where given), W [n, k] a
    constant as torch.nn.Linear keeps it, W)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) / 16).astype(dtype)
    m = tirx.Var("m", "int64") if rows is None else rows
    x, r = relax.Var("x", relax.TensorType([m, k], dtype)), relax.Var("r", relax.TensorType([m, n], dtype))

    def body(bb, x, *rest):
        y = relax.op.astype(bb.emit(relax.op.matmul(x, relax.op.permute_dims(relax.const(weight)), out_dtype="float32")), dtype)
        return relax.op.add(bb.emit(y), rest[0]) if rest else y

    return main_module(body, [x, r] if residual else [x]), weight


def build_quietly(mod, target):
    """The build, with any fallback to TVM's schedules an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return tvm_ext.build(mod, target)


@pytest.mark.parametrize("arch, tensor_core", [("sm_90a", "ptx_wgmma"), ("sm_80", "mma_sync")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_each_row_class_gets_a_kernel_of_its_own(arch, tensor_core, dtype):
    if dtype == "bfloat16" and arch == "sm_80":
        pytest.skip("bf16 on mma.sync: TVM 0.27 has no bf16 WMMA intrinsics (a symbolic bf16 matmul stays dlight's)")
    bodies = kernel_bodies(tvm_ext.cuda_source(build_quietly(linear(4096, 4096, dtype)[0], {"kind": "cuda", "arch": arch})))
    variants = sorted(name for name in bodies if re.search(r"_v\d+_kernel$", name))
    assert len(variants) >= 5, sorted(bodies)
    single, *few = variants[:3]  # _v0: one row; _v1, _v2: up to 16 and 32
    tiled = variants[3:]
    assert "__shfl" in bodies[single] and "mma" not in bodies[single] and "threadIdx.y" not in bodies[single]  # ours, not dlight's
    assert all("mma.sync.aligned.m16n8k16" in bodies[name] for name in few)
    assert all(tensor_core in bodies[name] for name in tiled), tiled
    if tensor_core == "ptx_wgmma":  # a block's tile, in a short last group of rows of tiles, is worked out once, not per use
        assert all(0 < bodies[name].count("% min(") <= 2 for name in tiled), [bodies[name].count("% min(") for name in tiled]


def test_row_classes_are_planned_for_their_sizes_and_end_with_the_rest():
    target = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_90a"})
    (func,) = [f for gv, f in fused_module(linear(4096, 4096, "float16")[0], target).functions_items()
               if "matmul" in gv.name_hint]
    with target:
        kernels = contraction_kernels(func, target)
    conditions = [str(cond) for cond, _, _ in kernels]
    assert conditions[-1] == "None" and all(re.fullmatch(r"m <= T.int64\(\d+\)", c) for c in conditions[:-1]), conditions
    bounds = [int(re.search(r"\((\d+)\)", c).group(1)) for c in conditions[:-1]]
    assert bounds == sorted(bounds) and set(bounds) <= {b for b, _ in MATMUL_ROW_CLASSES} | set(few_row_matmul.ROW_CLASSES)
    assert [knobs["strategy"] for _, knobs, _ in kernels[:2]] == ["few_row_matmul"] * 2 and bounds[:2] == [16, 32]
    tiles = [(knobs["block_m"], knobs["block_n"]) for _, knobs, _ in kernels[2:]]
    assert len(set(tiles)) == len(tiles), tiles  # classes planned alike share one kernel
    assert tiles[0][0] * tiles[0][1] < tiles[-1][0] * tiles[-1][1]  # few rows: small tiles, more blocks


def test_the_dispatch_is_a_host_side_compare_on_the_row_count():
    target = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        scheduled = ScheduleContractions()(relax.transform.ToNonDataflow()(fused_module(linear(4096, 4096, "float16")[0],
                                                                                         target)))
    script = scheduled["main"].script()
    assert re.search(r"if m == 1", script) and re.search(r"if m <= \d+", script), script
    assert len(re.findall(r"R.call_tir\(fused_matmul\w*_v\d+", script)) >= 3, script


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_rows_that_are_an_expression_of_the_length_dispatch_on_it(arch):
    """BERT's [batch x seq, hidden] rows: the kernels take seq as a scalar parameter, and the
    dispatch's compare reads the caller's value of it (left undefined, the build failed)."""
    seq = tirx.Var("seq", "int64")
    weight = np.ones((256, 128), "float16")
    x = relax.Var("x", relax.TensorType([2, seq, 128], "float16"))

    def body(bb, x):
        rows = bb.emit(relax.op.reshape(x, [2 * seq, 128]))
        return relax.op.astype(bb.emit(relax.op.matmul(rows, relax.op.permute_dims(relax.const(weight)),
                                                        out_dtype="float32")), "float16")

    kernels = tvm_ext.cuda_kernels(build_quietly(main_module(body, [x]), {"kind": "cuda", "arch": arch}))
    assert sum(bool(re.search(r"_v\d+_kernel$", k)) for k in kernels) >= 2, kernels


def test_a_record_stands_for_the_row_class_it_was_measured_in(tmp_path):
    """A matmul built for any row count, tuned at 512 rows: its record replaces the kernel of the
    class that serves 512 rows and no other (one record replaced every class, the few-row ones too:
    the LLaMA layer built for any length ran 1.24x slower at 128 tokens with a log tuned at 512).
    The tuner's baseline is that class's heuristic point, its records say the sizes they were
    measured at, and a resumed run at other sizes does not count them; a record without sizes
    stands for NOMINAL rows; a record for a few-row class, of another template, replaces nothing."""
    from tvm_ext.records import Database, append_record  # noqa: PLC0415
    from tvm_ext.schedules.dispatch import heuristic_knobs, row_class_at  # noqa: PLC0415
    from tvm_ext.search.measure import Result  # noqa: PLC0415
    from tvm_ext.search.strategy import TaskSearch  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    target = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_90a"})
    (task,) = extract_tasks(linear(4096, 4096, "float16")[0], target)
    log = tmp_path / "log.json"
    with target:
        kernels = contraction_kernels(task.func, target)
        at, last = row_class_at(kernels, {"m": 512}), len(kernels) - 1
        assert at not in (row_class_at(kernels, {"m": 16}), last) and row_class_at(kernels, {}) == last
        search = TaskSearch(task, target, str(log), 8, {"m": 512})
        assert search.heuristic == kernels[at][1] == search.points[0] == heuristic_knobs(task.func, target, {"m": 512})
        heuristics = [knobs for _, knobs, _ in kernels]
        tuned, nominal = [p for p in search.points if p not in heuristics][:2]
        search._record(search.points.index(tuned), Result(tuned, [10.0], None))  # pylint: disable=protected-access
        append_record(log, task.func, target, task.name, nominal, 20.0)
        logged = Database.load(log).lookup_classes(task.func, target)
        assert logged == [({"m": 512}, tuned), ({}, nominal)]
        replaced = [knobs for _, knobs, _ in contraction_kernels(task.func, target, logged)]
        assert replaced == heuristics[:at] + [tuned] + heuristics[at + 1:last] + [nominal]
        assert [knobs for _, knobs, _ in contraction_kernels(task.func, target, [({"m": 8}, tuned)])] == heuristics
        past = [rec for rec in map(json.loads, log.read_text().splitlines())]
        assert len(TaskSearch(task, target, str(log), 8, {"m": 512}, past).measured) == 1
        assert len(TaskSearch(task, target, str(log), 8, {"m": 2048}, past).measured) == 0


def test_a_symbolic_row_task_is_featured_at_the_rows_it_is_measured_at():
    """Its candidates' features are those of the same matmul built for 512 rows, but for the symbolic
    column: the cost model learns from the size it measured (it took 4096 rows for every length)."""
    from tvm_ext.search.features import NAMES, candidate_features  # noqa: PLC0415
    from tvm_ext.search.strategy import TaskSearch  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    target = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_90a"})
    (symbolic,) = extract_tasks(linear(4096, 4096, "float16")[0], target)
    (static,) = extract_tasks(linear(4096, 4096, "float16", rows=512)[0], target)
    search = TaskSearch(symbolic, target, "unused.json", 8, {"m": 512})
    x, want = search.x, candidate_features(static.func, search.points, target)
    flag = NAMES.index("symbolic")
    assert (x[:, flag] == 1).all() and (want[:, flag] == 0).all()
    np.testing.assert_array_equal(np.delete(x, flag, axis=1), np.delete(want, flag, axis=1))
    assert not np.array_equal(x, candidate_features(symbolic.func, search.points, target))  # at 4096 rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1536, 768)])
def test_every_row_class_matches_numpy_on_gpu(n, k, dtype, rng):
    mod, weight = linear(n, k, dtype)
    main = VirtualMachine(tvm_ext.build(mod, "cuda"), tvm.cuda())["main"]
    for m in (1, 3, 8, 9, 16, 17, 32, 33, 64, 100, 256, 300, 1000):
        x, r = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((m, n)).astype(dtype)
        got = main(tvm.runtime.tensor(x, tvm.cuda()), tvm.runtime.tensor(r, tvm.cuda())).numpy().astype("float32")
        want = x.astype("float32") @ weight.astype("float32").T + r.astype("float32")
        tolerance = 1e-2 if dtype == "float16" else 6e-2
        np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max(), rtol=0, err_msg=f"{m} rows")


@pytest.mark.parametrize("arch, strategy", [("sm_90a", "wgmma_matmul"), ("sm_80", "matmul")])
def test_a_symbolic_row_matmul_is_a_task_the_tuner_can_start(arch, strategy, tmp_path):
    """Its candidates' features take NOMINAL rows for the symbolic count and say it is symbolic
    (int() of the row Var used to raise as the tuner started); every point is one the build takes."""
    from tvm_ext.schedules.dispatch import knobs_problem  # noqa: PLC0415
    from tvm_ext.search.features import NAMES  # noqa: PLC0415
    from tvm_ext.search.strategy import TaskSearch  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    target = tvm_ext.parse_target({"tag": "nvidia/nvidia-h100", "arch": arch})
    (task,) = extract_tasks(linear(4096, 4096, "float16")[0], target)
    search = TaskSearch(task, target, str(tmp_path / "log.json"), 8)
    assert {p["strategy"] for p in search.points} == {strategy}
    assert np.isfinite(search.x).all() and (search.x[:, NAMES.index("symbolic")] == 1).all()
    assert (search.x[:, NAMES.index("log2_k_per_step")] > 0).all()
    assert all(knobs_problem(task.func, target, p) is None for p in search.points)
