"""Every suite op compiled for CUDA on a machine without a GPU; assertions on the generated source."""

import re
import shutil
import warnings

import pytest
import tvm
from tvm.support import nvcc

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from barriers import divergent_barriers
from helpers import CASES
from tvm_ext import schedules
from tvm_ext.pipeline import fused_reduce_functions
from tvm_ext.schedules import block_row, warp_row

# bn_stats (mean and variance of the same x) is paired into one Welford kernel.
KERNELS: dict = {}


def expected_kernels(case) -> int:
    """One per fused function, times the width classes when the row width is symbolic (each bound
    three times, widths a 16- or an 8-byte vector divides and the rest, less scalar classes alike, the
    first scalar class split by the row count), or two over a symbolic row count for a LayerNorm
    of block_row's widths or float32 rows that many rows keep in registers (fewer rows than SMs, and
    the rest), times the int32 and int64 versions when any dim is (tvm_ext/tir/narrowing.py)."""
    symbolic_width = isinstance(case["shape"][-1], str)
    symbolic = any(isinstance(d, str) for d in case["shape"])
    row_bytes = 0 if symbolic_width else case["shape"][-1] * (4 if case["dtype"] == "float32" else 2)
    few_rows = symbolic and not symbolic_width and (
        case["op"] == "layer_norm" and row_bytes > warp_row.MAX_ROW_BYTES
        or case["dtype"] == "float32" and row_bytes >= block_row.REGISTER_ROW_BYTES)
    classes = width_classes(case) if symbolic_width else 2 if few_rows else 1
    return KERNELS.get(case["op"], 1) * classes * (2 if symbolic else 1)
_built = {}


def width_classes(case) -> int:
    """Kernels planned for a fused function of a symbolic-width case (dispatch.width_classes: a class
    that re-reads its rows like the next one of its vector width is that one's)."""
    target = tvm_ext.parse_target(CUDA_TARGET)
    func = next(iter(fused_reduce_functions(relax_module(case["op"], case["shape"], case["dtype"]), target).values()))
    return len(schedules.plan(func, target))


def build_case(case):
    if case["id"] not in _built:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ex = tvm_ext.build(relax_module(case["op"], case["shape"], case["dtype"]), CUDA_TARGET)
        fallbacks = [str(w.message) for w in caught if "tvm_ext:" in str(w.message)]
        _built[case["id"]] = (ex, tvm_ext.cuda_source(ex), fallbacks)
    return _built[case["id"]]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_one_cross_thread_kernel_per_fused_reduction(case):
    ex, src, fallbacks = build_case(case)
    assert fallbacks == [], "our schedules must serve every suite op"
    assert len(tvm_ext.cuda_kernels(ex)) == expected_kernels(case)
    if case["op"] == "col_sum":  # lanes along threadIdx.y meet in a shared-memory tree
        assert "threadIdx.y" in src and "__syncthreads" in src
    else:  # the reduce axis is spread over threadIdx.x and combined by warp shuffles
        assert "__shfl_down_sync" in src


@pytest.mark.parametrize("case", [c for c in CASES if c["op"] in ("layer_norm", "softmax") and "dynamic" not in c
                                  and c["shape"][-1] * 2 <= 64 * 1024], ids=lambda c: c["id"])
def test_row_read_once_into_shared_memory_or_registers(case):
    _, src, _ = build_case(case)
    elem = "half" if case["dtype"] == "float16" else "nv_bfloat16"
    if re.search(rf"{elem} p0_local_ptr\[\d+\];", src) and "p0_shared" not in src:  # rows kept in registers
        # each lane loads its chunks once, 4 halves at a time (its epilogue's stores), at constant indices
        assert re.search(rf"\*\({elem}4\*\)\(p0_local_ptr \+ \d+\) = \*\({elem}4\*\)\(p0_ptr", src)
        assert src.count("p0_ptr[") == (1 if case["op"] == "layer_norm" else 0), "x read once (and Welford's pivot)"
        return
    assert re.search(rf"extern __shared__ __align__\(\d+\) {elem} p0_shared_dyn_ptr\[\];", src)
    assert re.search(r"\*\(uint4\*\)\(p0_shared_dyn_ptr \+ .*= \*\(uint4\*\)\(p0_ptr", src), "staged by 16-byte loads"
    assert src.count("p0_ptr[") == 0, "after staging, x must never be read from global memory again"
    # LayerNorm's Welford reduction too: its pivot (the row's first element) is a register of its own
    assert re.search(r"= \*\(uint4\*\)\(p0_shared_dyn_ptr \+", src), "reductions take their chunk as one 16-byte read"


# rows of 96 KB to 200 KB: a block may opt in to 227 KB on sm_90, 99 KB on sm_86
LARGE_ROWS = [("softmax", 50257, "float16", 100), ("softmax", 32000, "float32", 128),
              ("layer_norm", 65536, "float16", 128), ("rms_norm", 100000, "bfloat16", 200),
              ("layer_norm", 24576, "float32", 96)]


@pytest.mark.parametrize("op, width, dtype, kb", LARGE_ROWS, ids=[f"{o}-{w}-{d}" for o, w, d, _ in LARGE_ROWS])
def test_rows_up_to_the_blocks_shared_memory_are_read_once(op, width, dtype, kb):
    """A row staged in shared memory is read from HBM once; re-read, each pass of the chain costs a
    full read (softmax over GPT-2's 50257 logits: four passes over memory instead of two)."""
    for arch, staged in (("sm_90", True), ("sm_86", kb <= 95)):  # less 4 KB for the reductions
        src = tvm_ext.cuda_source(tvm_ext.build(relax_module(op, [1024, width], dtype), {"kind": "cuda", "arch": arch}))
        assert ("extern __shared__" in src) == staged, arch
        if staged:  # every pass after the first reads the stage
            assert src.count("p0_ptr[") + src.count("(p0_ptr +") <= 2 * max(1, width // 1024), arch


def test_dynamic_rows_compile_to_an_int32_and_an_int64_kernel_with_symbolic_grid():
    """Each class of row counts (fewer than the SMs, the rest) in both index widths; the few-row
    class in larger blocks, and chosen on the host by the row count."""
    case = next(c for c in CASES if c["id"] == "ln-dyn-nx4096-f16")
    ex, src, _ = build_case(case)
    assert tvm_ext.cuda_kernels(ex) == [f"layer_norm_v{i}{s}_kernel" for i in range(2) for s in ("_i32", "")]
    for i in range(2):
        assert re.search(rf"void __launch_bounds__\(\d+\) layer_norm_v{i}_i32_kernel\([^)]*, int n\)", src)
        assert re.search(rf"void __launch_bounds__\(\d+\) layer_norm_v{i}_kernel\([^)]*, int64_t n\)", src)
    few, many = (int(re.search(rf"__launch_bounds__\((\d+)\) layer_norm_v{i}_kernel", src).group(1)) for i in range(2))
    assert few > many
    assert ex.as_text().count("If    ") == 3, "a branch on the row count, and an int32/int64 branch per class"


def test_symbolic_row_width_dispatches_between_variants_at_run_time():
    case = next(c for c in CASES if c["id"] == "sm-dyn-bxn-f16")
    ex, src, _ = build_case(case)
    target = tvm_ext.parse_target(CUDA_TARGET)
    (func,) = fused_reduce_functions(relax_module(case["op"], case["shape"], case["dtype"]), target).values()
    plan = schedules.plan(func, target)
    # six width bounds, each with 16- and 8-byte vector classes and a scalar one (less scalar classes
    # another serves), the first scalar one twice: a block a row over fewer rows, a warp a row
    assert len(plan) == 17
    assert tvm_ext.cuda_kernels(ex) == sorted(f"softmax_v{i}{s}_kernel" for i in range(17) for s in ("_i32", ""))
    host = ex.as_text()
    calls = re.findall(r"call  (softmax\w*) ", host)
    assert calls == [f"softmax_v{i}{s}" for i in range(17) for s in ("_i32", "")], "narrowest first, int32 first"
    assert host.count("If    ") == 33, "sixteen class branches, and an int32/int64 branch per class"
    kernel = lambda name: re.search(rf"{name}_kernel\([^)]*\) \{{(.*?)\n\}}", src, re.S).group(1)  # noqa: E731
    v0 = kernel("softmax_v0")
    assert "threadIdx.y" in v0 and "__shfl_down_sync" in v0  # warp_row: a warp per row, rows along y
    for i, (_, knobs) in enumerate(plan):
        threads = knobs["threads"] if knobs["strategy"] == "block_row" else warp_row.BLOCK_THREADS
        assert re.search(rf"__launch_bounds__\({threads}\) softmax_v{i}_kernel", src), i
        # widths a multiple of 8 or 4 halves: vector stores of whole chunks, no per-element tail test
        stores = re.search(r"\*\((half4|uint4|uint2)\*\)\(compute_ptr \+", kernel(f"softmax_v{i}"))
        assert bool(stores) == (knobs["vec"] > 1), i


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_generated_source_compiles_with_nvcc(case):
    _, src, _ = build_case(case)
    with tvm_ext.parse_target(CUDA_TARGET):
        cubin = nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
    assert bytes(cubin[:4]) == b"\x7fELF"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_no_barrier_under_a_thread_dependent_branch(case):
    assert divergent_barriers(build_case(case)[1]) == []


@pytest.mark.parametrize("op, dtype", [("layer_norm", "float16"), ("rms_norm", "bfloat16"), ("softmax", "float16"),
                                       ("softmax", "float32"), ("row_sum", "float32")])
@pytest.mark.parametrize("width", [96, 1000, 3000, 50257])  # tails of every kind
def test_odd_widths_have_no_divergent_barrier(op, dtype, width):
    src = tvm_ext.cuda_source(tvm_ext.build(relax_module(op, [37, width], dtype), CUDA_TARGET))
    assert divergent_barriers(src) == []


def _norms_of_one_input(rows):
    """LayerNorm and RMSNorm of the same x: both kernels stage x, TVM names both arrays x_shared_dyn_ptr."""
    from tvm import relax  # noqa: PLC0415

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([rows, 512], "float32"))
    g, b, w = (relax.Var(name, relax.TensorType([512], "float32")) for name in ("gamma", "beta", "w"))
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            r = bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-6))
            out = bb.emit_output(relax.Tuple([h, r]))
        bb.emit_func_output(out)
    return bb.get()


def test_kernels_declaring_one_dynamic_shared_name_with_two_types_get_their_own_names():
    # LayerNorm stages x as float (its Welford reduction reads it element-wise), RMSNorm as float4
    src = tvm_ext.cuda_source(tvm_ext.build(_norms_of_one_input(64), CUDA_TARGET))
    declared = re.findall(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", src)
    names = {}
    for dtype, name in declared:
        names.setdefault(name, set()).add(dtype)
    assert len(declared) >= 2 and all(len(dtypes) == 1 for dtypes in names.values()), declared
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(CUDA_TARGET):
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


@pytest.mark.parametrize("module", ["example", "ln-dyn"])
def test_shared_memory_stages_do_not_grow_with_a_symbolic_row_count(module):
    # a stage sized n x 512 instead of rows-per-block x 512 failed to launch on the H200 at n = 77
    from examples.transformer_norms import build_module  # noqa: PLC0415
    from tvm import tirx  # noqa: PLC0415

    stages = []

    @tirx.transform.prim_func_pass(opt_level=0, name="RecordStages")
    def record(func, _mod, _ctx):
        stages.extend(line for line in func.script().splitlines() if "alloc_buffer" in line and "shared.dyn" in line)
        return func

    mod = build_module() if module == "example" else relax_module("layer_norm", ["n", 4096], "float16")
    tvm_ext.register_tir_pass(record, phase="late")
    try:
        tvm_ext.build(mod, CUDA_TARGET)
    finally:
        tvm_ext.unregister_tir_pass(record)
    assert all(re.search(r"alloc_buffer\(\(T\.int64\(\d+\),\)|alloc_buffer\(\((\d+),\)", s) for s in stages), stages
    assert stages or module == "example", "one row per block: the stage stays, at a constant size"


def test_reductions_over_rows_left_in_memory_read_their_chunks_as_vectors():
    """Unstaged (cache off) and one chunk per lane (16 x 32 lanes = 512 columns), each lane's chunk
    reaches the reduction as 16-byte loads into registers, not one element per load: LLaMA's
    attention softmax at seq 512 (rows over two dims, so not staged) took 23 us that way, 20 now."""
    from tvm_ext.schedules import schedule  # noqa: PLC0415
    from tvm_ext.tir import TIR_PIPELINE  # noqa: PLC0415

    mod = tvm.relax.transform.LegalizeOps()(relax_module("softmax", [64, 512], "float16"))
    func = next(f for gv, f in mod.functions_items() if gv.name_hint != "main")
    knobs = {"strategy": "warp_row", "group": 32, "rows_per_block": 4, "vec": 16, "cache": False}
    target = tvm_ext.parse_target(CUDA_TARGET)
    sch = schedule(func, target, knobs)
    lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=target, tir_pipeline=TIR_PIPELINE)
    src = lib.mod.imports[0].inspect_source("cuda")
    loads = re.findall(r"\*\(uint4\*\)\(\w+_local_ptr(?:_\d+)? \+ \d+\) = \*\(uint4\*\)\(\w+_ptr", src)
    assert len(loads) >= 4  # two 16-byte loads per chunk of 16 halves, in the max and the sum pass
    assert not re.search(r"max\([^;]*\bp0_ptr\[", src), "the max must read registers, not memory"


def _column_sum_then_bias(rows: int, knobs: dict):
    """`sum(x[rows, 16, 512], axis=0) + bias` scheduled by column_reduce with `knobs`, built."""
    from tvm import relax  # noqa: PLC0415

    from bench.spelled import main_module  # noqa: PLC0415
    from tvm_ext.schedules import dispatch  # noqa: PLC0415

    x, bias = relax.Var("x", relax.TensorType([rows, 16, 512], "float32")), relax.Var("bias", relax.TensorType([512], "float32"))
    mod = main_module(lambda bb, x, bias: relax.op.add(relax.op.sum(x, axis=[0]), bias), [x, bias])
    target = tvm_ext.parse_target(CUDA_TARGET)
    fused = tvm_ext.pipeline.fused_module(mod, target)
    func = next(f for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    sch = dispatch.schedule(func, target, knobs)
    return tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)


COLUMN_KNOBS = [{"strategy": "column_reduce", "cols": 16, "lanes": 64}, {"strategy": "column_reduce", "cols": 256, "lanes": 1}]


@pytest.mark.parametrize("knobs", COLUMN_KNOBS, ids=["lanes", "serial"])
def test_a_column_sum_with_an_epilogue_reads_each_threads_own_column(knobs):
    """With the sum kept in shared memory, its region spanned the block's 16 columns: the lanes of
    threadIdx.y summed over columns as well as rows and every column wrote one slot, so the split-K
    sum of a 16-row matmul came out wrong on the H200. Each thread now keeps its column's sum."""
    src = _column_sum_then_bias(8, knobs).mod.imports[0].inspect_source()
    loads = re.findall(r"x_ptr\[([^\]]*)\]", src)
    assert loads and all("threadIdx.x" in index for index in loads)
    assert "threadIdx.x) >> " not in src.split("x_ptr[")[1].split("]")[0]  # no lane's column from threadIdx.y
    assert ("red_buf" in src) == (knobs["lanes"] > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", COLUMN_KNOBS, ids=["lanes", "serial"])
def test_a_column_sum_with_an_epilogue_is_right_on_the_gpu(knobs, rng):
    import numpy as np  # noqa: PLC0415

    x, bias = rng.standard_normal((8, 16, 512)).astype("float32"), rng.standard_normal(512).astype("float32")
    args = [tvm.runtime.tensor(v, tvm.cuda()) for v in (x, bias)] + [tvm.runtime.empty((16, 512), "float32", tvm.cuda())]
    _column_sum_then_bias(8, knobs)["main"](*args)
    np.testing.assert_allclose(args[2].numpy(), x.astype("float64").sum(0) + bias, rtol=1e-5, atol=1e-5)


# whole tiles and steps, scalar and vector loads; then tiles of 24 x 4 columns (85 and a third of them
# over 8192) and 6 splits of 180 rows in 20 lanes (the last split 100 rows, each's last step partial)
SPLIT_KNOBS = [{"strategy": "column_split", "cols": 32, "lanes": 8, "splits": 4, "vec": vec} for vec in (1, 4)] + [
    {"strategy": "column_split", "cols": 24, "lanes": 20, "splits": 6, "vec": 4}]
SPLIT_IDS = ["scalar", "vectors", "ragged"]


@pytest.mark.parametrize("knobs", SPLIT_KNOBS, ids=SPLIT_IDS)
def test_a_column_split_sum_with_an_epilogue_adds_the_bias_once_in_the_last_block(knobs):
    # the epilogue's two spatial dims come from the flat column, and only the tile's last block writes them
    lib = _column_sum_then_bias(1000, knobs)
    src = lib.mod.imports[0].inspect_source()
    before, body = src.split("atomicAdd", 1)
    assert "bias_ptr[" in body and "bias_ptr[" not in before.split("__global__")[-1]
    last = body.index("if (last_ptr[0] == 1) {")
    assert last < body.index("bias_ptr["), "only the tile's last block runs the epilogue"
    assert ("*(float4*)(x_ptr + " in before) == (knobs["vec"] == 4), "a 16-byte load a row where vec is 4"
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(CUDA_TARGET):
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", SPLIT_KNOBS, ids=SPLIT_IDS)
def test_a_column_split_sum_with_an_epilogue_is_right_on_the_gpu_twice(knobs, rng):
    import numpy as np  # noqa: PLC0415

    func = _column_sum_then_bias(1000, knobs)["main"]
    width = knobs["cols"] * knobs["vec"]
    tiles = -(-16 * 512 // width)  # a counter per tile, splits x width partials each
    state = [tvm.runtime.tensor(np.zeros(tiles, "int32"), tvm.cuda()),
             tvm.runtime.tensor(np.zeros(tiles * knobs["splits"] * width, "float32"), tvm.cuda())]
    for _ in range(2):  # the second call must find every ticket counter reset by the first
        x, bias = rng.standard_normal((1000, 16, 512)).astype("float32"), rng.standard_normal(512).astype("float32")
        args = [tvm.runtime.tensor(v, tvm.cuda()) for v in (x, bias)]
        out = tvm.runtime.empty((16, 512), "float32", tvm.cuda())
        func(args[0], args[1], *state, out)
        np.testing.assert_allclose(out.numpy(), x.astype("float64").sum(0) + bias, rtol=1e-4, atol=1e-3)


def masked_row_guard(rows=16, width=32):
    """softmax(x), with rows whose every score is -inf set to 0: how TVM imports PyTorch's SDPA."""
    from tvm import relax  # noqa: PLC0415
    from bench.spelled import main_module  # noqa: PLC0415

    op = relax.op

    def body(bb, x):
        seen = op.max(op.astype(op.logical_not(op.equal(x, relax.const(float("-inf"), "float32"))), "uint8"), axis=[-1],
                      keepdims=True)
        hidden = op.logical_not(op.not_equal(seen, relax.const(0, "uint8")))
        probs = op.nn.softmax(x, axis=-1)
        return op.where(hidden, op.zeros_like(probs), probs)

    return main_module(body, [relax.Var("x", relax.TensorType([rows, width], "float32"))])


def test_a_select_on_one_bool_per_row_is_a_branch():
    """A 4-lane select on a broadcast bool was printed as `float4 v = make_ushort4(...)` (nvcc rejects it)."""
    src = tvm_ext.cuda_source(tvm_ext.build(masked_row_guard(), {"kind": "cuda", "arch": "sm_80"}))
    assert "make_ushort4" not in src and "bool(v_" not in src
    if shutil.which("nvcc"):
        import subprocess, tempfile  # noqa: E401, PLC0415
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.cu", "w", encoding="utf-8") as f:
                f.write(src)
            assert subprocess.run(["nvcc", "-arch=sm_80", "-cubin", "-o", f"{tmp}/k.cubin", f"{tmp}/k.cu"],
                                  capture_output=True, check=False).returncode == 0


@pytest.mark.gpu
def test_a_select_on_one_bool_per_row_is_right_on_the_gpu():
    import numpy as np  # noqa: PLC0415
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    x = np.random.default_rng(0).standard_normal((16, 32)).astype("float32")
    x[3] = -np.inf
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(masked_row_guard(), "cuda"), dev)["main"](tvm.runtime.tensor(x, dev)).numpy()
    e = np.exp(x - x.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    ref[3] = 0
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
