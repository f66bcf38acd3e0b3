"""The public API: pipeline registration, bad input, tuning-log lookup, the TIR pass hook, fallback."""

import json
import re
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx
from tvm.script import tirx as T
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET, has_gpu
from tvm_ext import schedules
from tvm_ext.pipeline import fused_reduce_functions
from tvm_ext.records import append_record


def test_import_registers_the_pipeline_that_build_runs():
    mod = relax_module("softmax", [64, 1000], "float16")
    target = tvm_ext.parse_target(CUDA_TARGET)
    assert isinstance(relax.get_pipeline("tvm_ext"), tvm.transform.Pass)
    via_name = tvm.compile(mod, target=target, relax_pipeline="tvm_ext", tir_pipeline="tvm_ext")
    via_build = tvm_ext.build(mod, CUDA_TARGET)
    assert tvm_ext.cuda_source(via_name) == tvm_ext.cuda_source(via_build)
    assert "__shfl_down_sync" in tvm_ext.cuda_source(via_build)


def test_the_pipeline_by_name_alone_still_gets_our_tir_passes():
    """relax_pipeline="tvm_ext" without tir_pipeline="tvm_ext": TVM's default TIR pipeline would drop our
    tensor-core code (and a grid-sync kernel's cooperative launch); it runs ours instead and says so once."""
    from test_tensorize import linear_bias  # noqa: PLC0415

    mod = linear_bias(2048, 1024, 512)
    target = tvm_ext.parse_target(CUDA_TARGET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_name = tvm_ext.cuda_source(tvm.compile(mod, target=target, relax_pipeline="tvm_ext"))
    said = [str(w.message) for w in caught if 'tir_pipeline="tvm_ext"' in str(w.message)]
    assert len(said) == 1 and "tensor-core" in said[0]
    assert "wmma::mma_sync" in by_name and by_name == tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a module without kernels of ours: TVM's default, unchanged and silent
        tvm.compile(relax_module("softmax", [64, 1000], "float16"), target=target)


@pytest.mark.parametrize("target, match", [
    ("cuda -arch=sm_90", "unsupported target string 'cuda -arch=sm_90'"),
    ("rocm", "unsupported target string 'rocm'"),
    ({"kind": "no_such_kind"}, "invalid target"),
    (42, "unsupported target 42"),
    ({"kind": "cuda", "arch": "sm_999"}, "unknown CUDA arch 'sm_999': expected one of sm_20, "),
    (tvm.target.Target({"kind": "cuda", "arch": "sm_91"}), "unknown CUDA arch 'sm_91'"),
])
def test_bad_target_is_a_clear_value_error(target, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), target)


@pytest.mark.skipif(has_gpu(), reason="checks the message given when no GPU is visible")
def test_cuda_shorthand_without_gpu_says_so():
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "cuda")


def test_missing_database_is_file_not_found(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "llvm", database=missing)


def test_known_cuda_archs_come_from_tvm_and_are_all_accepted():
    from tvm_ext.target import known_cuda_archs  # noqa: PLC0415

    archs = known_cuda_archs()
    assert {"sm_70", "sm_80", "sm_89", "sm_90", "sm_100", "sm_120"} <= set(archs) and "sm_999" not in archs
    for arch in [*archs, "sm_90a", "sm_100a"]:
        assert str(tvm_ext.parse_target({"kind": "cuda", "arch": arch}).attrs["arch"]) == arch


def test_module_without_relax_main_is_a_value_error():
    mod = relax_module("row_sum", [4, 8], "float32")
    renamed = tvm.IRModule({tvm.ir.GlobalVar("forward"): mod["main"]})
    with pytest.raises(ValueError, match="no Relax function 'main'"):
        tvm_ext.build(renamed, "llvm")


@pytest.mark.parametrize("call, match", [
    (lambda ex, tmp: tvm_ext.build(None, "llvm"), "build: mod must be a tvm.IRModule .*, got NoneType"),
    (lambda ex, tmp: tvm_ext.build("def main(x): ...", "llvm"), "build: mod must be a tvm.IRModule .*, got str"),
    (lambda ex, tmp: tvm_ext.build(relax_module("row_sum", [4, 8], "float32")["main"], "llvm"),
     "build: mod must be a tvm.IRModule .*, got Function"),
    (lambda ex, tmp: tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "llvm", database=123),
     r"build: database must be the path of a tuning log \(str or os.PathLike\), a Database or None, got int"),
    (lambda ex, tmp: tvm_ext.export(None, tmp / "m.so"), "export: executable must be .*, got NoneType"),
    (lambda ex, tmp: tvm_ext.export(ex.mod, tmp / "m.so"), "export: executable must be .*, got Module"),
    (lambda ex, tmp: tvm_ext.export(ex, 123), "export: path must be a str or os.PathLike, got int"),
    (lambda ex, tmp: tvm_ext.load(123), "load: path must be a str or os.PathLike, got int"),
])
def test_wrong_argument_types_are_type_errors_naming_the_argument(call, match, tmp_path):
    ex = tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "llvm")
    with pytest.raises(TypeError, match=match):
        call(ex, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_unknown_build_option_is_named():
    with pytest.raises(ValueError, match="welfordd"):
        tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "llvm", welfordd=True)


def _layer_norm_task(target):
    mod = relax_module("layer_norm", [256, 4096], "float16")
    (name, func), = fused_reduce_functions(mod, tvm_ext.parse_target(target)).items()
    return mod, name, func


def test_database_knobs_replace_the_heuristic(tmp_path):
    mod, name, func = _layer_norm_task(CUDA_TARGET)
    heuristic = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    assert "__launch_bounds__(64)" not in heuristic and "p0_shared_dyn_ptr" in heuristic
    log = tmp_path / "log.jsonl"
    knobs = {"strategy": "block_row", "threads": 64, "vec": 4, "cache": False}
    append_record(log, func, tvm_ext.parse_target(CUDA_TARGET), name, knobs, us=10.0)
    append_record(log, func, tvm_ext.parse_target(CUDA_TARGET), name, dict(knobs, threads=128), us=20.0)  # slower
    tuned = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET, database=log))
    assert "__launch_bounds__(64)" in tuned and "p0_shared_dyn_ptr" not in tuned


def test_a_record_for_a_symbolic_width_leaves_its_width_classes(tmp_path):
    """A row of symbolic width is built as width classes chosen per call (vectors, rows in registers):
    it is not a tuning task, and a log's record for it (an older tuner's) does not replace them with
    the one kernel measured at one width."""
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    mod = relax_module("softmax", ["b", "s"], "float16")
    target = tvm_ext.parse_target(CUDA_TARGET)
    assert extract_tasks(mod, target) == []
    (name, func), = fused_reduce_functions(mod, target).items()
    log = tmp_path / "log.jsonl"
    append_record(log, func, target, name, {"strategy": "block_row", "threads": 64, "vec": 1, "cache": False}, us=1.0)
    plain, logged = (tvm_ext.build(mod, CUDA_TARGET, **kwargs) for kwargs in ({}, {"database": log}))
    classes = len(schedules.plan(func, target))  # each with its int32 twin
    assert tvm_ext.cuda_kernels(logged) == tvm_ext.cuda_kernels(plain) and len(tvm_ext.cuda_kernels(plain)) == 2 * classes > 2
    assert "__launch_bounds__(64)" not in tvm_ext.cuda_source(logged)


def test_a_record_for_symbolic_rows_keeps_the_class_of_fewer_rows_than_sms(tmp_path):
    """The record was measured at one row count: it replaces the kernel for many rows, and a decoding
    step's few rows keep theirs."""
    mod = relax_module("layer_norm", ["n", 4096], "float16")
    target = tvm_ext.parse_target(CUDA_TARGET)
    (name, func), = fused_reduce_functions(mod, target).items()
    log = tmp_path / "log.jsonl"
    append_record(log, func, target, name, {"strategy": "block_row", "threads": 64, "vec": 8, "cache": False}, us=1.0)
    plain, logged = (tvm_ext.build(mod, CUDA_TARGET, **kwargs) for kwargs in ({}, {"database": log}))
    assert len(tvm_ext.cuda_kernels(logged)) == len(tvm_ext.cuda_kernels(plain)) == 4  # two classes, int32 and int64
    def threads(ex) -> dict:  # {class: threads a block}, the few-row class first (v0)
        return {v: int(t) for t, v in re.findall(r"__launch_bounds__\((\d+)\) layer_norm_v(\d)_kernel", tvm_ext.cuda_source(ex))}
    assert threads(logged) == {"0": threads(plain)["0"], "1": 64} and threads(plain)["1"] != 64


def test_unusable_log_lines_are_skipped_with_a_warning(tmp_path):
    mod, name, func = _layer_norm_task(CUDA_TARGET)
    log = tmp_path / "log.jsonl"
    append_record(log, func, tvm_ext.parse_target(CUDA_TARGET), name,
                  {"strategy": "block_row", "threads": 64, "vec": 4, "cache": False}, us=10.0)
    good = log.read_text()
    other_version = json.loads(good)
    other_version.update(tvm="0.19.0", knobs={"strategy": "block_row", "threads": 32, "vec": 1, "cache": False})
    log.write_text(good + '{"key": "trunc' + "\n" + json.dumps(other_version) + "\n")
    with pytest.warns(UserWarning, match="skipped 2 unusable line"):
        src = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET, database=log))
    assert "__launch_bounds__(64)" in src  # the good record still applies, the foreign one does not


def test_tir_pass_hook_sees_scheduled_functions_and_device_kernels():
    seen = {"early": [], "late": []}

    def recorder(phase):
        @tirx.transform.prim_func_pass(opt_level=0, name=f"Record_{phase}")
        def record(func, _mod, _ctx):
            seen[phase].append((str(func.attrs["global_symbol"]), bool(func.attrs.get("tirx.is_scheduled", False))))
            return func
        return record

    passes = [tvm_ext.register_tir_pass(recorder(p), phase=p) for p in ("early", "late")]
    try:
        ex = tvm_ext.build(relax_module("softmax", [64, 1000], "float16"), CUDA_TARGET)
    finally:
        for p in passes:
            tvm_ext.unregister_tir_pass(p)
    # the pipeline first runs the schedule through the passes to check it builds (not yet marked scheduled)
    assert seen["early"] == [("softmax", False), ("softmax", True)]
    assert [name for name, _ in seen["late"]] == 2 * tvm_ext.cuda_kernels(ex) == 2 * ["softmax_kernel"]
    with pytest.raises(ValueError, match="unknown TIR pass phase 'middle'"):
        tvm_ext.register_tir_pass(recorder("early"), phase="middle")


def _one_op(op, shape):
    bb = relax.BlockBuilder()
    x, g, b = (relax.Var(n, relax.TensorType(shape, "float32")) for n in "xgb")
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            out = bb.emit_output(op(x, g, b))
        bb.emit_func_output(out)
    return bb.get()


def test_refused_function_falls_back_with_a_warning_and_stays_correct(rng):
    # a softmax down the columns: column_reduce takes no element-wise epilogue, the row templates no columns
    mod = _one_op(lambda x, g, b: relax.op.nn.softmax(x, axis=0), [6, 50])
    with pytest.warns(UserWarning, match=r"tvm_ext: softmax: no tvm_ext schedule matches it; falling back"):
        built = tvm_ext.build(mod, CUDA_TARGET)
    assert len(tvm_ext.cuda_kernels(built)) >= 1  # TVM's dlight rules built it
    xs = rng.standard_normal([6, 50]).astype("float32")
    out = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](*map(tvm.runtime.tensor, (xs, xs, xs)))
    e = np.exp(xs - xs.max(0))
    np.testing.assert_allclose(out.numpy(), e / e.sum(0), rtol=1e-5, atol=1e-6)


def test_a_layer_norm_over_every_axis_is_one_row_of_ours(rng):
    """A full reduction with element-wise work after it is a single row: served, not refused."""
    mod = _one_op(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[0, 1], epsilon=1e-5), [6, 50])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built = {"llvm": tvm_ext.build(mod, "llvm"), "cuda": tvm_ext.build(mod, CUDA_TARGET)}
    assert tvm_ext.cuda_kernels(built["cuda"]) == ["layer_norm_kernel"]
    xs, gs, bs = (rng.standard_normal([6, 50]).astype("float32") for _ in range(3))
    out = VirtualMachine(built["llvm"], tvm.cpu())["main"](*map(tvm.runtime.tensor, (xs, gs, bs)))
    np.testing.assert_allclose(out.numpy(), (xs - xs.mean()) / np.sqrt(xs.var() + 1e-5) * gs + bs, rtol=1e-4, atol=1e-5)


def test_matmuls_are_left_to_tvm_without_a_warning():
    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType([64, 128], "float16")), relax.Var("w", relax.TensorType([128, 64], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tvm_ext.cuda_kernels(tvm_ext.build(bb.get(), CUDA_TARGET))


@T.prim_func(s_tir=True)
def _unlowerable(a: T.Buffer((128,), "float32"), b: T.Buffer((1,), "float32")):
    # a branch on shared memory other threads write: TVM's barrier planner rejects it
    flag = T.sblock_alloc_buffer((1,), "int32", scope="shared")
    for tx in T.thread_binding(128, thread="threadIdx.x"):
        with T.sblock("set"):
            v = T.axis.spatial(128, tx)
            T.reads()
            T.writes(flag[0])
            if v == 0:
                flag[0] = 1
        with T.sblock("use"):
            v = T.axis.spatial(128, tx)
            T.reads(flag[0], a[v])
            T.writes(b[0])
            if v == 0 and flag[0] == 1:
                b[0] = a[v]


def test_schedule_that_fails_in_lowering_falls_back(monkeypatch):
    monkeypatch.setattr(schedules, "scheduled", lambda func, target, knobs=None: [(None, {}, s_tir.Schedule(_unlowerable))])
    with pytest.warns(UserWarning, match=r"tvm_ext: softmax: tvm_ext reduction templates failed \(InternalError: .*\); falling back to TVM.s default"):
        ex = tvm_ext.build(relax_module("softmax", [8, 300], "float32"), CUDA_TARGET)
    assert tvm_ext.cuda_kernels(ex) == ["softmax_kernel"]  # TVM's rules built the original function


def test_log_from_another_target_is_not_applied_and_says_so(tmp_path):
    """Records written for sm_80 must not schedule an sm_90 build: heuristic schedules, one warning."""
    mod, name, func = _layer_norm_task(CUDA_TARGET)
    log = tmp_path / "log.jsonl"
    a100 = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_80"})
    append_record(log, func, a100, name, {"strategy": "block_row", "threads": 64, "vec": 4, "cache": False}, us=10.0)
    with pytest.warns(UserWarning, match="no records for target cuda-sm_90"):
        src = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET, database=log))
    assert "__launch_bounds__(64)" not in src and src == tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
