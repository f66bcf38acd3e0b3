"""Auto-tensorization: each of the five steps on the thread-level matmul template, the pass, and the GPU."""

import logging
import shutil
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, te, tirx
from tvm.support import nvcc

import tvm_ext
from bench.matmul import template_func as legalized_matmul
from bench.spelled import main_module
from conftest import CUDA_TARGET
from tvm_ext.schedules import matmul
from tvm_ext.tir.tensorize import infer_fragments, match_mma


def linear(m, n, k):
    """C = A @ W^T with W stored [n, k], as torch.nn.Linear keeps it."""
    a, w = te.placeholder((m, k), "float16", name="a"), te.placeholder((n, k), "float16", name="w")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * w[j, r].astype("float32"), axis=r), name="c")
    return te.create_prim_func([a, w, c])


def scheduled(func, **knobs):
    sch = matmul.apply(func, {**matmul.default_knobs(), **knobs})
    assert sch is not None
    return sch.mod["main"]


def test_the_warp_tile_of_the_template_is_matched():
    found = match_mma(scheduled(legalized_matmul(256, 512, 128)))
    assert found is not None and found.warp_tile == (16, 64, 16)  # 16 rows x 32 lanes * 2 columns, 16 of k
    assert (found.c.scope(), found.a.source.scope(), found.b.source.scope()) == ("local", "local", "local")
    assert sorted(b.name for b in found.fills) == ["a_shared.dyn_local", "b_shared.dyn_local"]
    assert all(blk.reads[0].source.scope() == "shared.dyn" for blk in found.fills.values())
    assert found.drain.writes[0].source.scope() == "global"
    a, b = infer_fragments(found)
    assert (a.role, a.layout, a.buffer.name) == ("matrix_a", "row_major", "a_shared.dyn_local")
    assert (b.role, b.layout, b.buffer.name) == ("matrix_b", "row_major", "b_shared.dyn_local")


def test_a_transposed_weight_is_a_col_major_matrix_b():
    a, b = infer_fragments(match_mma(scheduled(linear(128, 256, 64))))
    assert (a.role, a.layout) == ("matrix_a", "row_major") and (b.role, b.layout) == ("matrix_b", "col_major")


def test_larger_warp_tiles_and_k_steps():
    found = match_mma(scheduled(legalized_matmul(256, 512, 128), block_m=128, warp_m=32, thread_n=2, block_k=32))
    assert found.warp_tile == (32, 64, 32)


def test_int8_rows_padded_off_16_bytes_are_refused():
    assert matmul.apply(legalized_matmul(256, 512, 128, "int8", "int32"), matmul.default_knobs()) is None  # 24 bytes
    assert matmul.apply(legalized_matmul(256, 512, 128, "int8", "int32"), {**matmul.default_knobs(), "pad": 16})


def test_what_is_not_a_tensor_core_matmul_is_left_alone(caplog):
    caplog.set_level(logging.DEBUG, logger="tvm_ext.tir.tensorize")
    assert matmul.apply(legalized_matmul(64, 64, 64, "float32", "float32"), matmul.default_knobs()) is None
    assert match_mma(legalized_matmul(64, 64, 64, "float32", "float32")) is None  # fp32 operands
    assert match_mma(scheduled(legalized_matmul(256, 512, 128), warp_m=8, block_m=32, vec=4)) is None
    assert "warp tile (8, 64, 16)" in caplog.text
    softmax = tvm_ext.pipeline.fused_reduce_functions(_softmax(), tvm_ext.parse_target(CUDA_TARGET))
    assert match_mma(next(iter(softmax.values()))) is None


def _softmax():
    return main_module(lambda bb, x: relax.op.nn.softmax(x), [relax.Var("x", relax.TensorType([64, 256], "float16"))])


def test_the_plain_template_builds_to_cuda_without_tensor_cores():
    func = scheduled(legalized_matmul(256, 512, 128)).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm_ext.parse_target(CUDA_TARGET))
    src = lib.mod.imports[0].inspect_source()
    assert "wmma" not in src and "__shared__" in src and "threadIdx.x" in src
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(CUDA_TARGET):
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


def test_thread_indices_are_unified_in_the_fragment_blocks_only():
    import tvm_ffi  # noqa: PLC0415

    from tvm_ext.tir.tensorize import unify_thread_indices  # noqa: PLC0415

    func = scheduled(legalized_matmul(256, 512, 128))
    found = match_mma(func)
    original, after = _realizes(func), _realizes(unify_thread_indices(func, found))
    fragment = ["matmul_init", "matmul_update", "matmul_local", "a_shared.dyn_local", "b_shared.dyn_local"]
    assert all(_uses(original[name], found.lane) for name in ("matmul_init", "matmul_update", "matmul_local"))
    assert not any(_uses(after[name], found.lane) for name in fragment)
    for copy in ("a_shared.dyn", "b_shared.dyn"):  # cooperative copies keep every thread's own indices
        assert tvm_ffi.structural_equal(after[copy].iter_values, original[copy].iter_values)


def _uses(realize, var) -> bool:
    import tvm_ffi  # noqa: PLC0415

    seen = []
    for value in realize.iter_values:
        tvm_ffi.structural_walk(value, (tirx.Var, lambda v: seen.append(v) if v.same_as(var) else None), order="pre")
    return bool(seen)


def _realizes(func) -> dict:
    import tvm_ffi  # noqa: PLC0415
    from tvm.s_tir.stmt import SBlockRealize  # noqa: PLC0415

    found = []
    tvm_ffi.structural_walk(func.body, (SBlockRealize, found.append), order="pre")
    return {r.block.name_hint: r for r in found}


def _calls(func) -> list:
    import tvm_ffi  # noqa: PLC0415

    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.expr.Call, lambda c: found.append(str(c.op.name))), order="pre")
    return found


def test_lane_loops_are_scaled_to_the_warp_tile():
    from tvm_ext.tir.tensorize import _loops_and_bindings, scale_lane_loops  # noqa: PLC0415

    func = scheduled(legalized_matmul(256, 512, 128))  # thread_n = 2: a lane's 2 columns -> the warp's 64
    found = match_mma(func)
    scaled = scale_lane_loops(func, found)
    update = next(r.block for name, r in _realizes(scaled).items() if name == "matmul_update")
    loops, bound = _loops_and_bindings(scaled, update)
    assert [int(lp.extent) for lp in loops if lp.thread_binding is None][-2:] == [16, 64]  # rows, warp's columns
    assert not _uses(_realizes(scaled)["matmul_update"], found.lane)
    assert [int(lp.extent) for lp in _loops_and_bindings(func, found.block)[0] if lp.thread_binding is None][-2:] == [16, 2]


@pytest.mark.parametrize("case", ["fp16", "weight [n, k]", "int8", "32x64x32 warp tile"])
def test_every_fragment_block_becomes_a_wmma_intrinsic(case):
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func = {"fp16": lambda: scheduled(legalized_matmul(256, 512, 128)),
            "weight [n, k]": lambda: scheduled(linear(128, 256, 64)),
            "int8": lambda: scheduled(legalized_matmul(256, 512, 128, "int8", "int32"), pad=16),
            "32x64x32 warp tile": lambda: scheduled(legalized_matmul(256, 512, 128), block_m=128, warp_m=32,
                                                    block_k=32)}[case]()
    tensorized = auto_tensorize(func)
    calls = _calls(tensorized)
    for builtin in ("tirx.tvm_fill_fragment", "tirx.tvm_mma_sync", "tirx.tvm_store_matrix_sync"):
        assert calls.count(builtin) == 1, builtin
    assert calls.count("tirx.tvm_load_matrix_sync") == 2
    scopes = {b.scope() for b in _allocated(tensorized)}
    assert {"wmma.matrix_a", "wmma.matrix_b", "wmma.accumulator", "shared.dyn"} == scopes  # no register copies left
    lib = tvm.compile(tvm.IRModule({"main": tensorized.with_attr("global_symbol", "main")}),
                      target=tvm_ext.parse_target(CUDA_TARGET))
    src = lib.mod.imports[0].inspect_source()
    for call in ("fill_fragment", "load_matrix_sync", "mma_sync", "store_matrix_sync"):
        assert f"nvcuda::wmma::{call}(" in src
    assert ("nvcuda::wmma::col_major" in src) == (case == "weight [n, k]")
    assert ("matrix_a, 16, 16, 16, signed char" in src) == (case == "int8")
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(CUDA_TARGET):
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


def _allocated(func) -> list:
    import tvm_ffi  # noqa: PLC0415
    from tvm.s_tir.stmt import SBlock  # noqa: PLC0415

    found = []
    tvm_ffi.structural_walk(func.body, (SBlock, lambda b: found.extend(b.alloc_buffers)), order="pre")
    return found


def test_a_bf16_matmul_and_a_non_matmul_stay_plain(caplog):
    from tvm_ext.tir.tensorize import AutoTensorize, auto_tensorize  # noqa: PLC0415

    caplog.set_level(logging.DEBUG, logger="tvm_ext.tir.tensorize")
    bf16 = scheduled(legalized_matmul(256, 512, 128, "bfloat16", "float32"))
    assert match_mma(bf16) is not None and auto_tensorize(bf16).same_as(bf16)
    assert "no 16x16x16 WMMA intrinsics for bfloat16" in caplog.text
    softmax = next(iter(tvm_ext.pipeline.fused_reduce_functions(_softmax(), tvm_ext.parse_target(CUDA_TARGET)).values()))
    mod = tvm.IRModule({"softmax": softmax, "mm": scheduled(legalized_matmul(256, 512, 128))})
    after = AutoTensorize(mod)
    assert after["softmax"].same_as(softmax) and "tirx.tvm_mma_sync" in _calls(after["mm"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp16", "weight [n, k]", "int8"])
def test_tensorized_matmul_is_right_on_the_gpu(case, rng):
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    m, n, k = 256, 512, 128
    func, dtype = {"fp16": (legalized_matmul(m, n, k), "float16"), "weight [n, k]": (linear(m, n, k), "float16"),
                   "int8": (legalized_matmul(m, n, k, "int8", "int32"), "int8")}[case]
    tensorized = auto_tensorize(scheduled(func, pad=16 if dtype == "int8" else 8)).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": tensorized}), target=tvm_ext.parse_target("cuda"))
    a = rng.integers(-4, 4, [m, k]).astype(dtype)
    b = rng.integers(-4, 4, [n, k] if case == "weight [n, k]" else [k, n]).astype(dtype)
    out_dtype = "int32" if dtype == "int8" else "float32"
    dev = tvm.cuda()
    args = [tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), tvm.runtime.empty([m, n], out_dtype, dev)]
    lib["main"](*args)
    want = a.astype("int64") @ (b.T if case == "weight [n, k]" else b).astype("int64")
    np.testing.assert_array_equal(args[2].numpy(), want.astype(out_dtype))


def linear_bias(m, n, k, dtype="float16"):
    """What FuseOps makes of a PyTorch fp16 Linear: the fp32 product, its cast back, the bias add."""
    a, w = relax.Var("a", relax.TensorType([m, k], dtype)), relax.Var("w", relax.TensorType([k, n], dtype))
    bias = relax.Var("bias", relax.TensorType([n], dtype))
    return main_module(lambda bb, a, w, bias: relax.op.add(
        relax.op.astype(relax.op.matmul(a, w, out_dtype="float32"), dtype), bias), [a, w, bias])


def batched(batch, m, n, k):
    a, b = relax.Var("a", relax.TensorType([batch, m, k], "float16")), relax.Var("b", relax.TensorType([batch, k, n], "float16"))
    return main_module(lambda bb, a, b: relax.op.astype(relax.op.matmul(a, b, out_dtype="float32"), "float16"), [a, b])


def _fused_matmul(mod):
    fused = tvm_ext.pipeline.fused_module(mod, tvm_ext.parse_target(CUDA_TARGET))
    return next(f for gv, f in fused.functions_items() if "matmul" in gv.name_hint)


@pytest.mark.parametrize("mod", [linear_bias(256, 512, 256), batched(12, 128, 128, 256)], ids=["epilogue", "batch"])
def test_every_tiling_of_an_epilogue_or_batched_matmul_becomes_tensor_core_code(mod):
    """The epilogue (cast, bias) is computed from a shared-memory stage the fragments are stored to;
    batch axes go to blockIdx.z. Every tiling that fits must build: small tiles once failed in TVM's
    StorageRewrite (an fp32 stage placed in the fp16 operand tiles)."""
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func, built = _fused_matmul(mod), 0
    for tiling in matmul.TILINGS:
        sch = matmul.apply(func, matmul.tiling_knobs(*tiling))
        if sch is None:
            continue
        with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
            lib = tvm.compile(tvm.IRModule({"main": auto_tensorize(sch.mod["main"]).with_attr("global_symbol", "main")}),
                              target=tvm_ext.parse_target(CUDA_TARGET))
        src = lib.mod.imports[0].inspect_source()
        assert "wmma::mma_sync" in src and "wmma::store_matrix_sync" in src, tiling
        assert ("blockIdx.z" in src) == (len(func.params[0].shape) == 3)
        built += 1
    assert built >= 5


def test_the_pipeline_gives_fp16_matmuls_to_the_template_and_bf16_ones_to_dlight():
    source = tvm_ext.cuda_source(tvm_ext.build(linear_bias(2048, 1024, 512), CUDA_TARGET))  # a wave of 128x128 tiles
    assert "wmma::mma_sync" in source and "cp.async" in source and "store_matrix_sync" in source
    bf16 = tvm_ext.cuda_source(tvm_ext.build(linear_bias(256, 512, 256, "bfloat16"), CUDA_TARGET))
    assert "cp.async" not in bf16  # dlight's schedule: no pipelined copies


@pytest.mark.gpu
@pytest.mark.parametrize("mod, shapes", [(linear_bias(512, 1024, 256), [[512, 256], [256, 1024], [1024]]),
                                         (batched(12, 128, 128, 256), [[12, 128, 256], [12, 256, 128]]),
                                         (linear_bias(16, 512, 2048), [[16, 2048], [2048, 512], [512]])],
                         ids=["epilogue", "batch", "split-k"])
def test_pipeline_matmuls_are_right_on_the_gpu(mod, shapes, rng):
    arrays = [rng.integers(-3, 4, s).astype("float16") for s in shapes]
    dev = tvm.cuda()
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    out = VirtualMachine(tvm_ext.build(mod, "cuda"), dev)["main"](*[tvm.runtime.tensor(a, dev) for a in arrays])
    want = arrays[0].astype("float32") @ arrays[1].astype("float32")
    want = want + arrays[2].astype("float32") if len(arrays) == 3 else want
    np.testing.assert_array_equal(out.numpy().astype("float32"), want.astype("float16").astype("float32"))


def _split_k_func(parts: int, part: int, index=lambda p, part, r: p * part + r):
    """Partial products of a 16 x 512 x (parts * part) matmul, `a` read at index(p, part, k)."""
    a = te.placeholder((16, parts * part), "float16", name="a")
    b = te.placeholder((parts * part, 512), "float16", name="b")
    r = te.reduce_axis((0, part), name="k")
    return te.create_prim_func([a, b, te.compute((parts, 16, 512), lambda p, i, j: te.sum(
        a[i, index(p, part, r)].astype("float32") * b[p * part + r, j].astype("float32"), axis=r), name="matmul")])


def test_split_k_partial_products_are_a_tensor_core_batch_reading_the_operands_in_place():
    """Part p reads a[i, p * K/S + k]: the template takes it with the parts on blockIdx.z; tilings
    whose k tile does not divide a part, and indices that mix rows or columns into k, are refused."""
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func = _split_k_func(4, 512)
    knobs = matmul.tiling_knobs(16, 16, 2, 2, 64, 4)
    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        lib = tvm.compile(tvm.IRModule({"main": auto_tensorize(matmul.apply(func, knobs).mod["main"])
                                        .with_attr("global_symbol", "main")}), target=tvm_ext.parse_target(CUDA_TARGET))
    src = lib.mod.imports[0].inspect_source()
    assert "wmma::mma_sync" in src and "(((int)blockIdx.z) * 512)" in src  # a's part: 512 columns on
    assert "(((int)blockIdx.z) * 262144)" in src  # b's part: 512 rows of 512
    assert matmul.apply(_split_k_func(4, 96), knobs) is None  # parts of 96: no whole 64-long k tiles
    assert matmul.apply(_split_k_func(4, 96), matmul.tiling_knobs(16, 16, 2, 2, 32, 3)) is not None
    assert matmul.contraction(_split_k_func(4, 512, lambda p, part, r: p + r)) is not None  # only p joins k
    a, b = te.placeholder((16, 528), "float16", name="a"), te.placeholder((16, 512), "float16", name="b")
    r = te.reduce_axis((0, 16), name="k")
    window = te.compute((16, 512), lambda i, j: te.sum(a[i, i + r].astype("float32") * b[r, j].astype("float32"), axis=r))
    assert matmul.contraction(te.create_prim_func([a, b, window])) is None  # row axis inside k's index


def test_a_few_row_matmul_is_split_along_k_into_a_tensor_core_batch_and_a_serial_column_sum():
    from tvm_ext.relax.split_k import parts  # noqa: PLC0415

    # 16 x 64 one-warp tiles for 132 SMs: parts until 1.5 blocks per SM, each at least 512 of K
    assert [parts(16, 4096, 4096, 132), parts(16, 11008, 4096, 132), parts(16, 512, 2048, 132)] == [4, 2, 4]
    assert [parts(64, 4096, 4096, 132), parts(16, 4096, 512, 132), parts(1, 4096, 4096, 132)] == [1, 1, 1]
    executable = tvm_ext.build(linear_bias(16, 512, 2048), CUDA_TARGET)
    assert tvm_ext.cuda_kernels(executable) == ["fused_split_k_sum_cast_add_kernel", "matmul_split_k_kernel"]
    source = tvm_ext.cuda_source(executable)
    assert "wmma::mma_sync" in source and "blockIdx.z" in source
    total = source[source.index("fused_split_k_sum_cast_add_kernel(half"):]
    total = total[:total.index("\n}\n")]
    assert "red_buf" not in total and "for (int" in total  # each thread adds its column's 4 parts alone
    assert tvm_ext.cuda_kernels(tvm_ext.build(linear_bias(256, 512, 2048), CUDA_TARGET)) == ["fused_matmul_cast_add_kernel"]


def _pipeline_annotations(func) -> dict:
    """{loop variable name: (stages, order)} of the software-pipelined loops of `func`."""
    import tvm_ffi  # noqa: PLC0415

    found = {}
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda lp: found.update(
        {lp.loop_var.name: tuple(tuple(int(x) for x in lp.annotations[key]) for key in
                                 ("software_pipeline_stage", "software_pipeline_order"))}
        if "software_pipeline_stage" in lp.annotations else {})), order="pre")
    return found


@pytest.mark.parametrize("stages, outer", [
    (3, ((0, 0, 1, 2, 2), (0, 1, 3, 2, 4))),  # the next tile's first fragments load before this tile's last mma
    (2, ((0, 0, 1, 1, 1), (0, 1, 2, 3, 4))),  # no stage free for that: fragments pipelined inside a tile only
])
def test_fragment_loads_join_the_software_pipeline(stages, outer):
    """Two 16-wide steps of k per shared tile: the fragments of the next step load while the tensor
    cores work on this one (two fragment buffers per operand in the CUDA), and the pass rewrites the
    schedule's pipeline over k-tiles to take the fragment loads in."""
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func = scheduled(legalized_matmul(512, 512, 256), block_m=128, warp_m=64, warp_n=2, block_n=128, block_k=32,
                     stages=stages)
    tensorized = auto_tensorize(func)
    annotations = sorted(_pipeline_annotations(tensorized).values())
    assert annotations == sorted([((0, 0, 1), (0, 1, 2)), outer])
    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        lib = tvm.compile(tvm.IRModule({"main": tensorized.with_attr("global_symbol", "main")}),
                          target=tvm_ext.parse_target(CUDA_TARGET))
    src = lib.mod.imports[0].inspect_source()
    assert "half, nvcuda::wmma::row_major> a_shared_dyn_wmma_matrix_a_ptr[8];" in src  # 2 buffers x 4 row tiles
    assert "cp_async_wait_group" in src


def test_one_k_step_per_tile_is_not_pipelined_further():
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func = scheduled(legalized_matmul(512, 512, 256), block_k=16, stages=3)
    assert list(_pipeline_annotations(auto_tensorize(func)).values()) == [((0, 0, 2), (0, 1, 2))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, acc", [("float16", "float32"), ("int8", "int32")])
def test_every_tiling_is_right_on_the_gpu(dtype, acc, rng):
    """Each tiling of TILINGS that fits, with its pipelined copies and fragment loads, gives the
    exact product of small integers (a race between a fragment load and the copy that refills its
    shared tile would show as wrong sums)."""
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    m, n, k = 512, 512, 512
    func, dev = legalized_matmul(m, n, k, dtype, acc), tvm.cuda()
    a, b = rng.integers(-3, 4, [m, k]).astype(dtype), rng.integers(-3, 4, [k, n]).astype(dtype)
    want = (a.astype("int64") @ b.astype("int64")).astype(acc)
    tested = 0
    for tiling in matmul.TILINGS:
        sch = matmul.apply(func, matmul.tiling_knobs(*tiling, itemsize=tvm.DataType(dtype).bits // 8))
        if sch is None:
            continue
        with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
            scheduled_func = auto_tensorize(sch.mod["main"]).with_attr("global_symbol", "main")
            lib = tvm.compile(tvm.IRModule({"main": scheduled_func}), target=tvm_ext.parse_target("cuda"))
        args = [tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), tvm.runtime.empty([m, n], acc, dev)]
        lib["main"](*args)
        np.testing.assert_array_equal(args[2].numpy(), want, err_msg=str(tiling))
        tested += 1
    assert tested >= 10


def test_a_tiling_beyond_the_shared_memory_a_block_may_have_is_refused():
    """Six stages of 16 x 128 and 128 x 128 tiles need 235008 bytes: the launch failed on the H200
    ("Failed to set the allowed dynamic shared memory size")."""
    knobs = matmul.tiling_knobs(16, 16, 2, 2, 128, 6)
    assert matmul.shared_bytes(knobs, 2) == 235008 > matmul.MAX_SHARED
    assert matmul.apply(legalized_matmul(16, 4096, 4096), knobs) is None
    assert matmul.apply(legalized_matmul(16, 4096, 4096), matmul.tiling_knobs(16, 16, 2, 1, 64, 12)) is not None


def test_int8_matmuls_get_the_template_with_16_byte_rows():
    """With fp16's padding of 8 elements an int8 row of 32 + 8 bytes is not 16-byte aligned: every
    tiling was refused, and TVM's own int8 path then failed to build (H200 run, session 8)."""
    func = legalized_matmul(1024, 1024, 1024, "int8", "int32")
    space = matmul.knob_space(func)
    assert len(space) >= 10 and all(k["pad"] == 16 for k in space)
    knobs, _ = matmul.heuristic(func, 132)
    assert knobs["pad"] == 16 and knobs["block_m"] == 128
    source = tvm_ext.introspect.cuda_source(tvm_ext.build(
        main_module(lambda bb, a, b: relax.op.matmul(a, b, out_dtype="int32"),
                    [relax.Var("a", relax.TensorType([1024, 1024], "int8")),
                     relax.Var("b", relax.TensorType([1024, 1024], "int8"))]), CUDA_TARGET))
    assert "wmma::mma_sync" in source and "signed char" in source


def _copy_out_bounds(func) -> list:
    """The predicates of the blocks that write the function's output buffer."""
    import tvm_ffi  # noqa: PLC0415

    out, found = func.params[-1], []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, lambda r: found.append(str(r.predicate))
                                        if any(w.source.same_as(out) for w in r.block.writes) else None), order="pre")
    return found


def test_a_matmul_that_tiles_do_not_divide_is_padded_and_its_edge_writes_are_bounds_checked():
    """4096 x 1000 x 1024 (the issue's fifth shape) went to dlight before. Now its operands are
    zero-filled up to whole tiles in the shared-memory copies (predicated cp.async), and the copy
    of C back to memory keeps the column bound that reverse_compute_inline would drop."""
    func = legalized_matmul(4096, 1000, 1000)
    knobs, sch = matmul.heuristic(func, 132)
    assert _copy_out_bounds(sch.mod["main"]) and all("1000" in p for p in _copy_out_bounds(sch.mod["main"]))
    tensorized = tvm_ext.tir.tensorize.auto_tensorize(sch.mod["main"])
    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        lib = tvm.compile(tvm.IRModule({"main": tensorized.with_attr("global_symbol", "main")}),
                          target=tvm_ext.parse_target(CUDA_TARGET))
    source = lib.mod.imports[0].inspect_source("cuda")
    assert "wmma::mma_sync" in source and "cp_async_legacy_pred" in source
    assert len(matmul.knob_space(func)) >= 5


def test_rows_that_are_not_whole_copy_vectors_stay_with_dlight():
    assert matmul.heuristic(legalized_matmul(256, 1001, 256), 132) is None  # B's rows: 1001 fp16
    assert matmul.heuristic(legalized_matmul(256, 256, 1001), 132) is None  # A's rows
    assert matmul.heuristic(legalized_matmul(250, 256, 256), 132) is not None  # M is not a row length


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(250, 1000, 200), (16, 1000, 4096), (4096, 1000, 1024)])
def test_padded_matmuls_are_right_on_the_gpu(m, n, k, rng):
    """Every tiling of an odd shape gives the exact product (a write past C's rows would show in
    the next row; a missing zero fill, as garbage in the sums)."""
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func, dev = legalized_matmul(m, n, k), tvm.cuda()
    a, b = rng.integers(-3, 4, [m, k]).astype("float16"), rng.integers(-3, 4, [k, n]).astype("float16")
    want = a.astype("float32") @ b.astype("float32")
    for knobs in matmul.knob_space(func):
        with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
            tensorized = auto_tensorize(matmul.apply(func, knobs).mod["main"]).with_attr("global_symbol", "main")
            lib = tvm.compile(tvm.IRModule({"main": tensorized}), target=tvm_ext.parse_target("cuda"))
        args = [tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), tvm.runtime.empty([m, n], "float32", dev)]
        lib["main"](*args)
        np.testing.assert_array_equal(args[2].numpy(), want, err_msg=str(knobs))


def test_the_heuristic_prefers_tiles_that_divide_c_over_padded_ones():
    """With padding allowed, a 128-row tile also 'fits' M = 16, and ties on block count with the
    16-row tiles: picked, it computed 8x the product (4 TFLOP/s through tvm_ext.build on the H200)."""
    knobs, _ = matmul.heuristic(legalized_matmul(16, 4096, 4096), 132)
    assert knobs["block_m"] == 16 and knobs["stages"] >= 8
    knobs, _ = matmul.heuristic(legalized_matmul(4096, 1000, 1024), 132)  # nothing divides 1000: padded
    assert knobs["block_n"] in (128, 256)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the CUDA source")
def test_every_int8_tiling_of_a_32_row_product_compiles_with_nvcc():
    """Padded int8 tiles are refused: TVM 0.27 prints their zero fill as make_int2 of 8 chars."""
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    func = legalized_matmul(32, 512, 512, "int8", "int32")
    space = matmul.knob_space(func)
    assert space and all(k["block_m"] <= 32 for k in space)
    for knobs in space:
        with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
            tensorized = auto_tensorize(matmul.apply(func, knobs).mod["main"]).with_attr("global_symbol", "main")
            lib = tvm.compile(tvm.IRModule({"main": tensorized}), target=tvm_ext.parse_target(CUDA_TARGET))
        with tvm_ext.parse_target(CUDA_TARGET):
            cubin = nvcc.compile_cuda(lib.mod.imports[0].inspect_source("cuda"), target_format="cubin", compiler="nvcc")
        assert bytes(cubin[:4]) == b"\x7fELF", knobs


def matmul_cast(m, k, n):
    """x @ w in float32, rounded to fp16: how from_torch imports an fp16 matmul."""
    x, w = relax.Var("x", relax.TensorType([m, k], "float16")), relax.Var("w", relax.TensorType([k, n], "float16"))
    return main_module(lambda bb, x, w: relax.op.astype(relax.op.matmul(x, w, out_dtype="float32"), "float16"), [x, w])


def test_k_padded_alone_keeps_the_epilogue_and_tensor_cores():
    """K = 688 (LLaMA-style intermediate sizes) pads K only: C and its cast are written as they are."""
    target = {"kind": "cuda", "arch": "sm_80"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it raised a ScheduleError in the template
        src = tvm_ext.cuda_source(tvm_ext.build(matmul_cast(128, 688, 256), target))
    assert "mma_sync" in src


@pytest.mark.gpu
def test_k_padded_matmul_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    x, w = rng.standard_normal((128, 688)).astype("float16"), (rng.standard_normal((688, 256)) / 16).astype("float16")
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(matmul_cast(128, 688, 256), "cuda"), dev)["main"](
        tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)).numpy()
    np.testing.assert_allclose(out.astype("float32"), x.astype("float32") @ w.astype("float32"), rtol=1e-2, atol=1e-2)


def test_operands_that_share_a_name_keep_the_tensor_cores():
    """Two Relax values of one name (`lv`, as a legalization's own bindings may be called) give a
    matmul whose operand buffers share it: it was read as a row reduction (buffers told apart by
    name) and, scheduled as a matmul, its copies were blocks of one name the tensorizer could not find."""
    a, b = relax.Var("lv", relax.TensorType([256, 512], "float16")), relax.Var("lv", relax.TensorType([512, 512], "float16"))
    mod = main_module(lambda bb, a, b: relax.op.astype(relax.op.matmul(a, b, out_dtype="float32"), "float16"), [a, b])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to TVM's default
        src = tvm_ext.cuda_source(tvm_ext.build(mod, {**CUDA_TARGET, "arch": "sm_80"}))
    assert "mma_sync" in src
