"""Few-row matmuls (schedules/few_row_matmul.py): up to 32 rows of X against a weight W [n, k], the
weight as the mma's A operand. What the template takes, the code it writes, where the dispatch puts
it, and (GPU) its numbers at every knob point, row count and edge."""

import re

import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
import pytest
import tvm
from tvm import te, tirx

import tvm_ext
from tvm_ext.schedules import contraction_kernels, few_row_matmul

SM_90A = {"kind": "cuda", "arch": "sm_90a"}


def matmul_func(n: int, k: int, dtype: str = "float16", rows=None, epilogue: str = "residual", w_layout: str = "nk"):
    """`x @ W^T` over x [rows, k] (rows symbolic unless given), W [n, k] (or [k, n] for "kn"), as
    FuseOps leaves it: the float32 sum, then nothing ("none"), a cast, or a cast and a residual add."""
    m = tirx.Var("m", "int64") if rows is None else rows
    x = te.placeholder((m, k), dtype, name="x")
    w = te.placeholder((n, k) if w_layout == "nk" else (k, n), dtype, name="w")
    r = te.reduce_axis((0, k))
    weight = (lambda j, kk: w[j, kk]) if w_layout == "nk" else (lambda j, kk: w[kk, j])
    c = te.compute((m, n), lambda i, j: te.sum(x[i, r].astype("float32") * weight(j, r).astype("float32"), axis=r))
    if epilogue == "none":
        return te.create_prim_func([x, w, c])
    y = te.compute((m, n), lambda i, j: c[i, j].astype(dtype))
    if epilogue == "cast":
        return te.create_prim_func([x, w, y])
    res = te.placeholder((m, n), dtype, name="res")
    return te.create_prim_func([x, w, res, te.compute((m, n), lambda i, j: y[i, j] + res[i, j])])


def cuda_of(func) -> str:
    lib = tvm.compile(tvm.IRModule({"mm": func.with_attr("global_symbol", "mm")}), target=tvm.target.Target(SM_90A))
    return lib.mod.imports[0].inspect_source()


@pytest.mark.parametrize("case, fits", [
    (dict(rows=None), True), (dict(rows=32), True), (dict(rows=33), False),  # more rows: the tiled classes
    (dict(dtype="bfloat16"), True), (dict(epilogue="none"), True),
    (dict(k=1004), False),  # k not a whole number of 16-byte loads
    (dict(w_layout="kn"), False),  # W read across k: no 16-byte run of one weight row
])
def test_what_the_template_takes(case, fits):
    args = {"n": 1000, "k": 1000, **case}
    assert bool(few_row_matmul.knob_space(matmul_func(**args))) is fits


def test_the_kernel_streams_16_byte_weight_rows_into_m16n8k16_mmas():
    func = matmul_func(4096, 4096, "bfloat16")
    knobs, sch = few_row_matmul.heuristic(func, 132)
    src = cuda_of(sch.mod["main"])
    body = src[src.index("mm_kernel("):]
    assert knobs == {"strategy": "few_row_matmul", "rows": 16, "warps": 8, "unroll": 16}
    steps = knobs["unroll"]
    assert body.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * 2 * steps  # 2 k16 a step, 2 row tiles
    assert len(re.findall(r"\*\(uint4\*\)\(w_ptr \+", body)) == 2 * steps  # rows g and g + 8 of W, 16 bytes each
    assert len(re.findall(r"if \(\(int64_t\)8 < m\)", body)) >= steps  # X's rows 9-16 and their mmas only when present
    assert "uint4 regs" not in src and "half regs" not in src  # the registers keep their element type (mma offsets)


@pytest.mark.parametrize("n, k, rows, knobs", [(11008, 4096, 16, (4, 2)), (4096, 11008, 16, (4, 16)), (4096, 4096, 16, (8, 16)),
                                               (4096, 4096, 32, (8, 4)), (4096, 11008, 32, (8, 2))])
def test_heuristic_picks_small_blocks_for_wide_weights_and_the_most_steps_in_flight_otherwise(n, k, rows, knobs):
    found, _ = few_row_matmul.heuristic(matmul_func(n, k), 132, rows=rows)
    assert (found["rows"], found["warps"], found["unroll"]) == (rows, *knobs)


@pytest.mark.parametrize("rows, served", [(1, 16), (16, 16), (17, 32), (32, 32), (33, None)])
def test_a_static_row_count_takes_the_smallest_class_that_holds_it(rows, served):
    found = few_row_matmul.heuristic(matmul_func(4096, 4096, rows=rows), 132)
    assert (found[0]["rows"] if found else None) == served


@pytest.mark.parametrize("arch, few_rows", [("sm_90a", True), ("sm_80", True), ("sm_75", False)])
def test_symbolic_rows_up_to_32_get_the_few_row_kernels_from_sm_80(arch, few_rows):
    target = tvm_ext.parse_target({"kind": "cuda", "arch": arch})
    with target:
        kernels = contraction_kernels(matmul_func(4096, 4096), target)
    few = [(str(condition), knobs["rows"]) for condition, knobs, _ in kernels if knobs["strategy"] == "few_row_matmul"]
    assert few == ([("m <= T.int64(16)", 16), ("m <= T.int64(32)", 32)] if few_rows else [])
    assert all(knobs["strategy"] == "few_row_matmul" for _, knobs, _ in kernels[:len(few)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n, k, epilogue, every_point", [(1000, 1000, "residual", True), (4096, 4096, "cast", False),
                                                         (264, 11008, "none", False)])
def test_the_kernels_match_numpy_on_gpu(n, k, epilogue, every_point, dtype, rng):
    """Every knob point at an edge case (n not a multiple of 16, k of 32: lanes past k); the
    heuristic's points of both row classes elsewhere; each at row counts within its class."""
    func = matmul_func(n, k, dtype, epilogue=epilogue)
    weight = (rng.standard_normal((n, k)) / 16).astype(dtype)
    out_dtype = "float32" if epilogue == "none" else dtype
    dev = tvm.cuda()
    points = few_row_matmul.knob_space(func) if every_point and dtype == "float16" else \
        [few_row_matmul.heuristic(func, 132, rows=rows)[0] for rows in few_row_matmul.ROW_CLASSES]
    for knobs in points:
        lib = tvm.compile(tvm.IRModule({"mm": few_row_matmul.apply(func, knobs).mod["main"].with_attr("global_symbol", "mm")}),
                          target="cuda")
        for m in (1, 2, 7, 8, 9, 16) if knobs["rows"] == 16 else (17, 24, 25, 32):
            x, res = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((m, n)).astype(dtype)
            want = x.astype("float32") @ weight.astype("float32").T + (res.astype("float32") if epilogue == "residual" else 0)
            args = [x, weight] + ([res] if epilogue == "residual" else []) + [np.zeros((m, n), out_dtype)]
            args = [tvm.runtime.tensor(a, dev) for a in args]
            lib["mm"](*args)
            tolerance = 1e-2 if dtype == "float16" else 6e-2
            np.testing.assert_allclose(args[-1].numpy().astype("float32"), want, atol=tolerance * np.abs(want).max(), rtol=0,
                                       err_msg=f"{knobs} {m} rows")
