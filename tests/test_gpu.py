"""On a real GPU: every suite op built by tvm_ext for "cuda", run, and compared with float64 NumPy."""

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from helpers import CASES, assert_close, concrete_shape, instantiate, run_case, variance_module
from patterns import PATTERNS, check, module

pytestmark = pytest.mark.gpu


def gpu_shape(case: dict) -> list:
    """Row counts cut to at most 37 (odd, to hit partial blocks); reduce extents as in the suite."""
    op, shape = case["op"], case["shape"]
    if op == "bn_stats":
        return [7, shape[1], shape[2], shape[3]]
    if op in ("full_sum", "col_sum"):
        return [shape[0] + 5] + shape[1:]  # not a multiple of any block size
    return [d if isinstance(d, str) else min(d, 37) for d in shape[:-1]] + shape[-1:]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_suite_case_on_gpu(case, rng):
    shape = gpu_shape(case)
    executable = tvm_ext.build(relax_module(case["op"], shape, case["dtype"]), "cuda")
    for values in instantiate(case, shape, row_cap=4099):
        outs, refs = run_case(executable, tvm.cuda(0), case["op"], concrete_shape(shape, values), case["dtype"], rng)
        assert_close(outs, refs, case["dtype"])


@pytest.mark.parametrize("width", [1000, 1024, 1025, 16384, 16385, 20000])  # each side of each class bound
def test_symbolic_width_variants_on_gpu(width, rng):
    executable = tvm_ext.build(relax_module("softmax", ["b", "s"], "float16"), "cuda")
    outs, refs = run_case(executable, tvm.cuda(0), "softmax", [3, width], "float16", rng)
    assert_close(outs, refs, "float16")


@pytest.mark.parametrize("width", [1000, 21952, 401408])
def test_welford_variance_on_gpu(width, rng):
    # the cross-thread combine must see each component's old value (state order matters in TVM)
    xs = (rng.standard_normal((5, width)) * 2 + 0.5).astype("float32")
    got = VirtualMachine(tvm_ext.build(variance_module(5, width), "cuda"), tvm.cuda(0))["main"](
        tvm.runtime.tensor(xs, tvm.cuda(0)))
    ref = xs.astype("float64").var(1)
    assert float(np.max(np.abs(got.numpy() - ref) / ref)) < 1e-5


@pytest.mark.parametrize("shape", [[37, 1024], [37, 4096], [37, 8192], [1000, 16384]])  # warp_row, block_row 256-1024 threads
def test_row_sums_read_in_16_byte_chunks_on_gpu(shape, rng):
    executable = tvm_ext.build(relax_module("row_sum", shape, "float32"), "cuda")
    outs, refs = run_case(executable, tvm.cuda(0), "row_sum", shape, "float32", rng)
    assert_close(outs, refs, "float32")


@pytest.mark.parametrize("op, dtype", [("layer_norm", "float16"), ("rms_norm", "bfloat16"), ("softmax", "float16"),
                                       ("row_sum", "float32")])
@pytest.mark.parametrize("width", [96, 1000, 50257])  # not a multiple of any pack or warp width
def test_odd_widths_on_gpu(op, dtype, width, rng):
    shape = [37, width]
    executable = tvm_ext.build(relax_module(op, shape, dtype), "cuda")
    outs, refs = run_case(executable, tvm.cuda(0), op, shape, dtype, rng)
    assert_close(outs, refs, dtype)


@pytest.mark.parametrize("op, width, dtype", [("softmax", 50257, "float16"), ("softmax", 32000, "float32"),
                                             ("layer_norm", 65536, "float16"), ("rms_norm", 100000, "bfloat16")])
def test_rows_staged_up_to_the_blocks_shared_memory_on_gpu(op, width, dtype, rng):
    shape = [257, width]  # more rows than SMs: one row a block, staged (100 to 200 KB a block)
    executable = tvm_ext.build(relax_module(op, shape, dtype), "cuda")
    assert "extern __shared__" in tvm_ext.cuda_source(executable)
    outs, refs = run_case(executable, tvm.cuda(0), op, shape, dtype, rng)
    assert_close(outs, refs, dtype)


@pytest.mark.parametrize("shape, dtype", [([257, 60000], "float32"), ([257, 151936], "float16"), ([3, 257, 70001], "float32")])
def test_online_softmax_on_gpu(shape, dtype, rng):
    """Rows larger than a block's stage take the one-pass (sum, max) statistics, one row a block."""
    executable = tvm_ext.build(relax_module("softmax", shape, dtype), "cuda")
    assert "softmax_state" in tvm_ext.cuda_source(executable)
    outs, refs = run_case(executable, tvm.cuda(0), "softmax", shape, dtype, rng)
    assert_close(outs, refs, dtype)


_BUILT = {}


@pytest.mark.parametrize("op, dtype", [("softmax", "float16"), ("rms_norm", "bfloat16"), ("layer_norm", "float32")])
# each side of each class bound; widths 8 bytes divide, not 16 (halves; floats: 1002, 4102)
@pytest.mark.parametrize("width", [7, 24, 64, 1000, 1003, 2560, 4104, 8192, 8200, 16384, 16392, 20001, 32768, 32776,
                                   1002, 1012, 4100, 4102, 16396])
def test_symbolic_width_vector_classes_on_gpu(op, dtype, width, rng):
    # widths a multiple of a 16-byte vector take the vector kernels, then of an 8-byte one, the others
    # the scalar ones; a class of rows in registers tests each of its lanes' steps against the width
    # (7, 24: most idle)
    if (op, dtype) not in _BUILT:  # one build serves every width
        _BUILT[op, dtype] = tvm_ext.build(relax_module(op, ["b", "s"], dtype), "cuda")
    outs, refs = run_case(_BUILT[op, dtype], tvm.cuda(0), op, [5, width], dtype, rng)
    assert_close(outs, refs, dtype)


@pytest.mark.parametrize("op, dtype", [("softmax", "float16"), ("rms_norm", "bfloat16")])
@pytest.mark.parametrize("rows", [5, 8448])  # each side of dispatch's few-rows limit for an H100 or H200
def test_symbolic_width_scalar_classes_over_few_and_many_rows_on_gpu(op, dtype, rows, rng):
    # widths up to 1024 no vector divides: a block a row over few rows, a warp a row over many
    if (op, dtype) not in _BUILT:
        _BUILT[op, dtype] = tvm_ext.build(relax_module(op, ["b", "s"], dtype), "cuda")
    for width in (77, 1003):
        outs, refs = run_case(_BUILT[op, dtype], tvm.cuda(0), op, [rows, width], dtype, rng)
        assert_close(outs, refs, dtype)


@pytest.mark.parametrize("op, shape, dtype", [
    ("col_sum", [262147, 64], "float32"), ("col_sum", [100000, 100], "float32"), ("col_sum", [65536, 256], "float16"),
    ("col_sum", [131072, 1024], "float32"), ("col_sum", [1048576, 16], "float32")])
def test_column_split_on_gpu_three_calls_in_a_row(op, shape, dtype, rng):
    # rows split over blocks: a wrong ticket or counter reset shows on the second and third calls
    executable = tvm_ext.build(relax_module(op, shape, dtype), "cuda")
    assert "cs_counter" in tvm_ext.cuda_source(executable)
    for _ in range(3):
        outs, refs = run_case(executable, tvm.cuda(0), op, shape, dtype, rng)
        assert_close(outs, refs, dtype)


@pytest.mark.parametrize("op, shape, concrete", [
    ("softmax", [2, 4, 100, 100], None), ("softmax", [2, 4, 50, 128], None), ("softmax", [2, 2, 2, 100, 100], None),
    ("softmax", [2, 4, "s", "s"], [2, 4, 77, 77]), ("softmax", [2, 4, "s", "s"], [2, 4, 200, 200]),
    ("layer_norm", [2, "s", 128], [2, 77, 128]), ("layer_norm", [2, "s", 768], [2, 13, 768])])
def test_rows_over_several_axes_whose_blocks_cross_a_row_dim_on_gpu(op, shape, concrete, rng):
    # blocks of several rows cross from one head (or batch entry) to the next: static and symbolic dims
    executable = tvm_ext.build(relax_module(op, shape, "float16"), "cuda")
    outs, refs = run_case(executable, tvm.cuda(0), op, concrete or shape, "float16", rng)
    assert_close(outs, refs, "float16")


def test_grid_reduce_counter_is_left_zeroed_for_the_next_call(rng):
    # a wrong reset would make the second call's last block fire early (or never)
    vm = VirtualMachine(tvm_ext.build(relax_module("row_sum", [3, 200003], "float32"), "cuda"), tvm.cuda(0))
    for _ in range(3):
        xs = rng.standard_normal((3, 200003)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(xs, tvm.cuda(0))).numpy()
        np.testing.assert_allclose(got, xs.astype("float64").sum(1), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern_on_gpu(name, rng):
    check(name, VirtualMachine(tvm_ext.build(module(name), "cuda"), tvm.cuda(0)), tvm.cuda(0), rng)


@pytest.mark.parametrize("op, shape, dtype, variance", [
    ("rms_norm", [16, 262144], "bfloat16", "welford"), ("softmax", [8, 131072], "float16", "welford"),
    ("layer_norm", [8, 262144], "float16", "welford"), ("layer_norm", [4, 200003], "float32", "two_pass"),
    ("softmax", [3, 1000003], "float32", "welford")])
def test_grid_sync_on_gpu_twice_in_a_row(op, shape, dtype, variance, rng):
    # one cooperative launch per call; the second call reuses the partials workspace
    executable = tvm_ext.build(relax_module(op, shape, dtype), "cuda", variance=variance)
    for _ in range(2):
        outs, refs = run_case(executable, tvm.cuda(0), op, shape, dtype, rng)
        assert_close(outs, refs, dtype)


@pytest.mark.parametrize("width", [1024, 8192, 65536, 262144])
@pytest.mark.parametrize("mean", [0.0, 1e4])
def test_welford_variance_meets_1e_6_on_gpu_where_one_pass_fails(width, mean, rng):
    xs = (rng.standard_normal((3, width)) + mean).astype("float32")
    ref = xs.astype("float64").var(1)

    def error(algorithm):
        vm = VirtualMachine(tvm_ext.build(variance_module(3, width), "cuda", variance=algorithm), tvm.cuda(0))
        return float(np.max(np.abs(vm["main"](tvm.runtime.tensor(xs, tvm.cuda(0))).numpy() - ref) / ref))

    assert error("welford") <= 1e-6
    assert (error("one_pass") > 1e-6) == bool(mean), "one-pass fails the bar exactly where the mean is large"


@pytest.mark.parametrize("op, shape", [("std", [6, 3000]), ("batch_norm", [16, 64, 28, 28]), ("group_norm", [8, 64, 28, 28])])
def test_norm_ops_on_gpu(op, shape, rng):
    from test_norm_ops import module, reference  # noqa: PLC0415

    x = (rng.standard_normal(shape) * 2 + 100).astype("float32")
    params = [rng.standard_normal(shape[1]).astype("float32") for _ in range(3)] + [rng.random(shape[1]).astype("float32")]
    args = [x] + (params[:2] if op == "group_norm" else params if op == "batch_norm" else [])
    out = VirtualMachine(tvm_ext.build(module(op, shape), "cuda"), tvm.cuda(0))["main"](
        *[tvm.runtime.tensor(a, tvm.cuda(0)) for a in args])
    outs = [o.numpy() for o in out] if op == "batch_norm" else [out.numpy()]
    for got, want in zip(outs, reference(op, *args)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
