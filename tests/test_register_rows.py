"""Rows kept in registers (the row templates' cache="registers"): each lane's chunks of an input the
chain reads twice or more are loaded once into its registers, and every block of the chain (the
reductions and the epilogue) takes the same chunks, so no lane reads another's."""

import re
import shutil
import subprocess

import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from helpers import assert_close, run_case
from patterns import check, module
from tvm_ext.pipeline import fused_reduce_functions
from tvm_ext.records import append_record
from tvm_ext.schedules import heuristic_knobs
from tvm_ext.schedules.analysis import match
from tvm_ext.schedules.dispatch import STRATEGIES, device_of, schedule
from tvm_ext.schedules.rows import REGISTER_BYTES, REGISTERS
from tvm_ext.tir.source_hook import FLOAT8, float8_vectors

TARGET = tvm_ext.parse_target(CUDA_TARGET)


def _task(mod, **options):
    (name, func), = fused_reduce_functions(mod, TARGET, **options).items()
    return name, func


def _register_points(func, strategy=None):
    pattern, device = match(func), device_of(TARGET)
    return [p for s in STRATEGIES.values() for p in s.knob_space(pattern, device)
            if p.get("cache") == REGISTERS and (strategy is None or p["strategy"] == strategy)]


def _cuda(func, knobs):
    sch = schedule(func, TARGET, knobs)
    lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=TARGET)
    return lib.mod.imports[0].inspect_source("cuda")


def test_a_layer_norm_row_in_registers_is_read_once_without_shared_memory():
    _, func = _task(relax_module("layer_norm", [4096, 320], "bfloat16"))
    knobs = {"strategy": "warp_row", "group": 8, "rows_per_block": 4, "vec": 8, "cache": REGISTERS}
    src = _cuda(func, knobs)
    # 320 columns over 8 lanes: 40 elements a lane, five 16-byte loads of x, each once
    assert re.search(r"nv_bfloat16 p0_local_ptr\[40\];", src)
    assert len(re.findall(r"\*\(uint4\*\)\(p0_local_ptr \+ \d+\) = \*\(uint4\*\)\(p0_ptr", src)) == 5
    # x is read from memory nowhere else but the pivot (the row's first element)
    assert len(re.findall(r"p0_ptr\[", src)) == 1
    assert "__shared__" not in src and "__syncthreads" not in src
    # the epilogue reads the lane's registers at constant indices, a chunk of 8 at a time
    assert re.search(r"= \*\(uint4\*\)\(p0_local_ptr \+ 32\);", src)


def test_register_points_are_offered_only_where_a_lanes_share_fits():
    _, short = _task(relax_module("layer_norm", [4096, 1024], "float16"))
    groups = {p["group"] for p in _register_points(short, "warp_row")}
    # 2 KB of x a row: 16 lanes or more keep at most REGISTER_BYTES each
    assert groups == {g for g in (2, 4, 8, 16, 32) if 2048 / g <= REGISTER_BYTES} == {16, 32}
    _, long = _task(relax_module("layer_norm", [512, 8192], "float32"))
    assert {p["threads"] for p in _register_points(long, "block_row")} == {256, 512, 1024}
    _, row_sum = _task(relax_module("row_sum", [512, 1024], "float32"))
    assert _register_points(row_sum) == []  # x read once: nothing to keep
    _, symbolic = _task(relax_module("softmax", ["b", "s"], "float16"))
    assert not any(_register_points(f) for f in [symbolic])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("op, shape, dtype", [("layer_norm", [64, 1000], "float16"),
                                              ("softmax", [64, 4096], "float32"),
                                              ("rms_norm", [64, 768], "bfloat16")])
def test_every_register_point_compiles_without_local_memory(op, shape, dtype, tmp_path):
    _, func = _task(relax_module(op, shape, dtype))
    points = [p for p in _register_points(func) if p.get("vec", 1) >= 4]
    assert points
    for knobs in points:
        (tmp_path / "k.cu").write_text(_cuda(func, knobs))
        ptxas = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                                str(tmp_path / "k.cu")], capture_output=True, text=True, check=True).stderr
        frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", ptxas)]
        assert frames and not any(frames), f"{knobs}: a lane's chunks went to local memory ({ptxas})"


def test_8_lane_float32_vectors_made_from_lanes_are_spelled_out():
    code = ('extern "C" __global__ void k(float* p) {\n'
            '  ulonglong4 a = make_ulonglong4((p[0] + f(1, 2)), p[1], p[2], p[3], p[4], p[5], p[6], p[7]);\n'
            '  ulonglong4 b = make_ulonglong4(1, 2, 3, 4);\n}\n')
    fixed = float8_vectors(code)
    assert f"ulonglong4 a = {FLOAT8}((p[0] + f(1, 2)), p[1]," in fixed  # 8 arguments: 8 floats, packed
    assert "ulonglong4 b = make_ulonglong4(1, 2, 3, 4);" in fixed  # 4: a true ulonglong4, kept
    assert fixed.index(f"ulonglong4 {FLOAT8}(") < fixed.index('extern "C"')  # defined before the kernel
    assert float8_vectors(code.replace("p[6], p[7]", "p[6]")) == code.replace("p[6], p[7]", "p[6]")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_halves_in_registers_store_their_8_lane_chunks_whole(tmp_path):
    _, func = _task(relax_module("layer_norm", [4096, 1024], "float16"))
    src = _cuda(func, {"strategy": "warp_row", "group": 32, "rows_per_block": 1, "vec": 8, "cache": REGISTERS})
    assert f"{FLOAT8}(" in src  # the mean and the reciprocal deviation broadcast over 8 float32 lanes
    assert len(re.findall(r"\*\(uint4\*\)\(compute_ptr \+", src)) == 4  # 1024 / 32 lanes: four 16-byte stores
    (tmp_path / "k.cu").write_text(src)
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                   check=True, capture_output=True)


def _spread_sample(points: list[dict], per_kind: int = 3) -> list[dict]:
    """Up to `per_kind` points of each strategy at its widest and narrowest vector, spread over its
    lane counts (the register layout depends on lanes x vector; all points would take minutes)."""
    sample = []
    for strategy in sorted({p["strategy"] for p in points}):
        mine = [p for p in points if p["strategy"] == strategy]
        for vec in sorted({max(p["vec"] for p in mine), 1}):
            kind = [p for p in mine if p["vec"] == vec]
            sample += kind[::-(-len(kind) // per_kind)]
    return sample


def _build_at(mod, name, func, knobs, tmp_path, **options):
    log = tmp_path / "log.jsonl"
    log.unlink(missing_ok=True)
    append_record(log, func, TARGET, name, knobs, us=1.0)
    built = tvm_ext.build(mod, CUDA_TARGET, database=str(log), **options)
    src = tvm_ext.cuda_source(built)
    assert re.search(r"\w+_local_ptr\[\d+\];", src) and "_shared_dyn" not in src  # x in registers, not staged
    return built


@pytest.mark.gpu
@pytest.mark.parametrize("op, shape, dtype, variance", [
    ("layer_norm", [37, 320], "bfloat16", "welford"), ("layer_norm", [37, 1000], "float16", "welford"),
    ("layer_norm", [37, 256], "float16", "two_pass"), ("layer_norm", [37, 4096], "float32", "welford"),
    ("rms_norm", [37, 1024], "bfloat16", "welford"), ("softmax", [37, 768], "float16", "welford"),
    ("softmax", [37, 8192], "float32", "welford")])
def test_every_register_point_on_gpu(op, shape, dtype, variance, tmp_path, rng):
    mod = relax_module(op, shape, dtype)
    name, func = _task(mod, variance=variance)
    points = _register_points(func)
    assert points
    for knobs in _spread_sample(points):
        built = _build_at(mod, name, func, knobs, tmp_path, variance=variance)
        outs, refs = run_case(built, tvm.cuda(0), op, shape, dtype, rng)
        assert_close(outs, refs, dtype)


@pytest.mark.gpu
def test_log_softmax_in_registers_on_gpu(tmp_path, rng):
    mod = module("log_softmax")  # max, sum of exps and the epilogue: x read three times
    name, func = _task(mod)
    knobs = heuristic_knobs(func, TARGET)
    points = [p for p in _register_points(func) if p["strategy"] == knobs["strategy"]]
    assert points
    for point in points[:6]:
        check("log_softmax", VirtualMachine(_build_at(mod, name, func, point, tmp_path), tvm.cuda(0)), tvm.cuda(0), rng)
