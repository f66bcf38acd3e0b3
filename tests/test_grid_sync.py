"""The cooperative grid-sync strategy: few huge rows whose reductions feed work on every element."""

import re
import shutil
import subprocess

import pytest

from tvm_ext import schedules
import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from barriers import divergent_barriers
from helpers import build_recording_launch, variance_module
from tvm_ext.tir.cooperative_launch import COOPERATIVE_LAUNCH, DYNAMIC_SHARED_MEMORY
from tvm_ext.pipeline import fused_reduce_functions

TARGET = tvm_ext.parse_target(CUDA_TARGET)
# (op, shape, dtype, reductions): each reduction is one grid barrier. LayerNorm's statistics are
# one Welford reduction (three values through the barrier); over a width with a tail chunk
# (200003) it is built in two passes: a Welford state cannot mask the overhang.
CASES = [("rms_norm", [16, 262144], "bfloat16", 1), ("softmax", [8, 131072], "float16", 2),
         ("layer_norm", [8, 262144], "float16", 1), ("layer_norm", [4, 200003], "float32", 2)]


def options(op, shape):
    return {"variance": "two_pass"} if op == "layer_norm" and shape[-1] % 4096 else {}
_built = {}


def build(op, shape, dtype):
    """(executable, CUDA source, launch params of each device kernel) for one case."""
    key = (op, tuple(shape), dtype)
    opts = options(op, shape)
    if key not in _built:
        _built[key] = build_recording_launch(relax_module(op, shape, dtype), CUDA_TARGET, **opts)
    return _built[key]


@pytest.mark.parametrize("op, shape, dtype, _", CASES)
def test_few_huge_rows_with_element_epilogue_choose_grid_sync(op, shape, dtype, _):
    module = relax_module(op, shape, dtype)
    (plan,) = [schedules.plan(f, TARGET) for f in fused_reduce_functions(module, TARGET, **options(op, shape)).values()]
    ((condition, knobs),) = plan
    assert condition is None and knobs["strategy"] == "grid_sync"
    assert shape[0] * knobs["blocks_per_row"] <= 132 * 2, "the grid must be co-resident (2 blocks of 512 per SM)"


def test_many_rows_or_short_rows_do_not_need_a_grid_barrier():
    for op, shape in [("rms_norm", [2048, 32768]), ("softmax", [8, 4096])]:
        (plan,) = [schedules.plan(f, TARGET) for f in fused_reduce_functions(relax_module(op, shape, "float16"), TARGET).values()]
        assert plan[0][1]["strategy"] != "grid_sync"


@pytest.mark.parametrize("op, shape, dtype, reductions", CASES)
def test_one_kernel_one_grid_barrier_per_reduction_launched_cooperatively(op, shape, dtype, reductions):
    ex, src, launch = build(op, shape, dtype)
    (kernel,) = tvm_ext.cuda_kernels(ex)
    assert src.startswith("#include <cooperative_groups.h>\n")
    body = re.search(rf"{kernel}\([^)]*\) \{{(.*?)\n\}}", src, re.S).group(1)
    assert body.count("cooperative_groups::this_grid().sync();") == reductions
    assert body.count("__ldcg(") >= reductions, "partials of other blocks are read past L1"
    tags = launch[kernel]
    assert COOPERATIVE_LAUNCH in tags
    assert DYNAMIC_SHARED_MEMORY not in tags or tags[-1] == DYNAMIC_SHARED_MEMORY, "TVM wants that tag last"
    assert divergent_barriers(src) == []


def test_row_chunk_is_staged_once_with_16_byte_loads_and_never_reread():
    _, src, _ = build("softmax", [8, 131072], "float16")
    assert re.search(r"\*\(uint4\*\)\(gs_x_ptr \+ .*\) = \*\(uint4\*\)\(p0_ptr \+", src)
    assert src.count("p0_ptr[") == 0, "max, sum and the epilogue all read the staged chunk"


def test_kernels_without_a_grid_barrier_are_launched_normally():
    _, _, launch = build("rms_norm", [2048, 32768], "bfloat16")
    assert all(COOPERATIVE_LAUNCH not in tags for tags in launch.values())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("op, shape, dtype, _", CASES)
def test_compiles_with_at_most_64_registers(op, shape, dtype, _, tmp_path):
    # the grid is sized for 1024 resident threads per SM: more registers and the launch is refused
    src = tmp_path / "k.cu"
    src.write_text(build(op, shape, dtype)[1])
    out = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "--resource-usage", "-o", str(tmp_path / "k.cubin"), str(src)],
                         capture_output=True, text=True, check=True)
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", out.stdout + out.stderr)]
    assert registers and max(registers) <= 64, out.stderr


def test_welford_state_crosses_the_grid_barrier_as_three_values():
    ex, src, _ = build("layer_norm", [8, 262144], "float16")
    # 256 blocks: the three values of block b at b, 256 + b and 512 + b of one workspace
    slots = ["((int)blockIdx.x)", "(((int)blockIdx.x) + 256)", "(((int)blockIdx.x) + 512)"]
    assert all(f"gs_ws_float32_ptr[{slot}] = gs_part0_{c}_ptr[0];" in src for c, slot in enumerate(slots))
    merged = re.search(r"float gs_merged0_1 = (.*);", src).group(1)  # the mean: mean_a + (mean_b - mean_a) n_b / n
    assert "__ldcg((&(gs_ws_float32_ptr[" in merged and "__fdividef(" in merged
    # one workspace constant: the VM shares equal constants, so three zero arrays would be one memory
    (call,) = [line for line in ex.as_text().splitlines() if "call  layer_norm" in line]
    assert call.count("c[") == 1


def test_variance_of_few_huge_rows_is_one_welford_kernel_written_by_each_rows_first_block():
    module = variance_module(64, 131072)
    (plan,) = [schedules.plan(f, TARGET) for f in fused_reduce_functions(module, TARGET).values()]
    assert [(k["strategy"], k["blocks_per_row"]) for _, k in plan] == [("grid_sync", 4)]
    src = tvm_ext.cuda_source(tvm_ext.build(module, CUDA_TARGET))
    assert src.count("cooperative_groups::this_grid().sync();") == 1
    assert re.search(r"if \(\(\(\(\(int\)blockIdx\.x\) % 4\) == 0\) && \(\(\(int\)threadIdx\.x\) == 0\)\) \{\s*"
                     r"variance_out_ptr\[\(\(\(int\)blockIdx\.x\) >> 2\)\] = \(gs_tot0_0_ptr\[0\]", src)
