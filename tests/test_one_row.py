"""A single row (`[1, n]`, batch-1 decode): a norm or softmax is one launch over the row, one block
or a grid-sync kernel of a few blocks, never a block per output element (normalization drops the
unit row loop from the element-wise epilogue, which then read as n one-value rows)."""

import re
import shutil

import pytest
import tvm
import tvm_ffi
from tvm import tirx

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from helpers import assert_close, run_case
from tvm_ext.pipeline import fused_reduce_functions
from tvm_ext.schedules import heuristic_knobs

SM_90A = {**CUDA_TARGET, "arch": "sm_90a"}
OPS = ["rms_norm", "layer_norm", "softmax"]


def grids(mod, target) -> dict:
    """{kernel: blockIdx.x extent} of a CUDA build, read from the lowered kernels."""
    found = {}

    @tirx.transform.prim_func_pass(opt_level=0, name="RecordGrid")
    def record(func, _mod, _ctx):
        def visit(node):
            if node.attr_key == "thread_extent" and node.node.thread_tag == "blockIdx.x":
                found[str(func.attrs["global_symbol"])] = int(node.value)
        tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, visit), order="pre")
        return func

    tvm_ext.register_tir_pass(record, phase="late")
    try:
        kernels = tvm_ext.cuda_kernels(tvm_ext.build(mod, target))
    finally:
        tvm_ext.unregister_tir_pass(record)
    return {name: blocks for name, blocks in found.items() if name in kernels}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_a_single_row_is_one_block(op, dtype):
    assert list(grids(relax_module(op, [1, 8192], dtype), SM_90A).values()) == [1]


@pytest.mark.parametrize("op, width", [("rms_norm", 262144), ("softmax", 65536)])
def test_a_single_long_row_is_one_grid_sync_kernel_of_a_few_blocks(op, width):
    ((name, blocks),) = grids(relax_module(op, [1, width], "float32"), SM_90A).items()
    assert 1 < blocks <= 132 * 2, (name, blocks)


@pytest.mark.parametrize("op, width, dtype", [("softmax", 65536, "float16"), ("rms_norm", 262144, "float32"),
                                              ("rms_norm", 131072, "bfloat16")])
def test_a_single_long_row_is_read_from_memory_once_and_compiles(op, width, dtype):
    """The grid-sync kernel copies the block's chunk into shared memory with 16-byte vectors and every
    pass reads it there (the one-row loads x[0, k] were not recognised as the staged input, and
    the unread copy was compacted to a broadcast index that fp16's 8 lanes could not compile)."""
    target = {"kind": "cuda", "arch": "sm_90"}
    src = tvm_ext.cuda_source(tvm_ext.build(relax_module(op, [1, width], dtype), target))
    assert len(re.findall(r"p0_ptr[ +\[]", src)) == 1
    assert re.search(r"\*\((uint|float)4\*\)\(gs_x_ptr \+ \(\(\(int\)threadIdx\.x\) \* \d\)\) = \*\((uint|float)4\*\)\(p0_ptr", src)
    if shutil.which("nvcc"):
        from tvm.support import nvcc  # noqa: PLC0415

        with tvm_ext.parse_target(target):
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


@pytest.mark.parametrize("op, shape, threads", [("layer_norm", [1, 4096], 512), ("layer_norm", [8192, 4096], 128),
                                               ("rms_norm", [1, 4096], 128)])
def test_a_few_rows_of_welford_take_a_16_byte_vector_a_thread(op, shape, threads):
    """Latency, not bandwidth, bounds a single row: Welford's serial update chain is the longest
    per-element work, so a LayerNorm's row is spread over more threads; many rows keep 64 bytes a
    thread, and a one-value state (RMSNorm's sum) is quicker with fewer threads and reduction rounds."""
    target = tvm_ext.parse_target(SM_90A)
    (func,) = fused_reduce_functions(relax_module(op, shape, "float16"), target).values()
    with target:
        assert heuristic_knobs(func, target)["threads"] == threads


def test_more_rows_keep_a_block_per_row():
    assert list(grids(relax_module("rms_norm", [4, 8192], "float16"), SM_90A).values()) == [4]


@pytest.mark.parametrize("op", OPS)
def test_a_single_row_matches_numpy_on_llvm(op, rng):
    executable = tvm_ext.build(relax_module(op, [1, 4096], "float32"), "llvm")
    assert_close(*run_case(executable, tvm.cpu(), op, [1, 4096], "float32", rng), "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("op, width, dtype", [(op, 8192, dtype) for op in OPS for dtype in ("float16", "bfloat16")]
                         + [("rms_norm", 262144, "float32"), ("softmax", 65536, "float32"),
                            ("layer_norm", 131072, "float16")])
def test_a_single_row_matches_numpy_on_gpu(op, width, dtype, rng):
    executable = tvm_ext.build(relax_module(op, [1, width], dtype), "cuda")
    for _ in range(2):  # a grid-sync kernel leaves its partials ready for the next call
        assert_close(*run_case(executable, tvm.cuda(0), op, [1, width], dtype, rng), dtype)
