"""The warpgroup (wgmma) matmul template: which matmuls it takes, the CUDA it writes, and (GPU) its
numbers, alone and with the epilogue FuseOps puts after a matmul."""

import math
import shutil

import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.support import nvcc
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.matmul import template_func
from bench.spelled import main_module
from tvm_ext.schedules import dispatch, matmul, wgmma_matmul
from tvm_ext.introspect import cuda_source as cuda_source_of
from tvm_ext.pipeline import fused_module

SM_90A = {"kind": "cuda", "arch": "sm_90a"}


def cuda_source(func) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm.target.Target(SM_90A))
    return (lib.mod if hasattr(lib, "mod") else lib).imports[0].inspect_source()


def linear_gelu(m, n, k, dtype="float16"):
    """gelu(x @ W^T + bias) in fp16 (or `dtype`), W stored [n, k] as torch.nn.Linear keeps it."""
    x, w = relax.Var("x", relax.TensorType([m, k], dtype)), relax.Var("w", relax.TensorType([n, k], dtype))
    bias = relax.Var("bias", relax.TensorType([n], dtype))

    def body(bb, x, w, bias):
        y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32"))
        return relax.op.nn.gelu(relax.op.add(relax.op.astype(y, dtype), bias))

    return main_module(body, [x, w, bias])


def k_major(m, n, k, dtype="float16"):
    """C = A @ W^T with W stored [n, k], as torch.nn.Linear keeps it."""
    a, w = te.placeholder((m, k), dtype, name="a"), te.placeholder((n, k), dtype, name="w")
    r = te.reduce_axis((0, k), name="k")
    return te.create_prim_func([a, w, te.compute(
        (m, n), lambda i, j: te.sum(a[i, r].astype("float32") * w[j, r].astype("float32"), axis=r), name="c")])


def tiles(space) -> list:
    return list(dict.fromkeys((p["block_m"], p["block_n"]) for p in space))


def test_the_template_takes_fp16_and_bf16_matmuls_of_whole_64_row_tiles():
    space = wgmma_matmul.knob_space(template_func(256, 512, 256))
    assert tiles(space) == [(128, 256), (128, 128), (64, 256), (64, 128), (64, 64)]
    assert [(p["stages"], p.get("tma", 0)) for p in space if (p["block_m"], p["block_n"]) == (64, 128)] == \
        [(8, 0), (4, 0), (8, 1), (4, 1)]  # one block, two per SM; each also loaded by TMA (4 stages or more)
    assert {p["stages"] for p in space if p.get("tma")} == {8, 7, 5, 4}  # 128 x 256 and 64 x 256 in 2 stages: not by TMA
    assert wgmma_matmul.knob_space(template_func(4096, 1000, 1024)) == []  # N not a multiple of 64
    assert wgmma_matmul.knob_space(template_func(16, 4096, 4096)) == []  # fewer rows than a warpgroup's 64
    assert wgmma_matmul.knob_space(template_func(256, 512, 256, "bfloat16")) == space
    assert wgmma_matmul.knob_space(template_func(256, 512, 256, "int8", "int32")) == []
    assert wgmma_matmul.apply(template_func(256, 512, 256), {"block_m": 128, "block_n": 256, "stages": 5}) is None  # 240 KB


def test_the_last_column_of_tiles_may_pass_the_edge_of_c():
    # an n-major B comes in 64-column atoms: whole-atom tiles passing N = 2240 by at most 10% of it
    assert tiles(wgmma_matmul.knob_space(template_func(256, 2240, 128))) == \
        [(128, 256), (128, 192), (128, 128), (64, 256), (64, 128), (64, 64)]
    # a k-major B (nn.Linear's [n, k]) also takes the narrower tiles: 3 x 224 passes 640 by 32, 3 x 256 by 128
    assert tiles(wgmma_matmul.knob_space(k_major(256, 640, 128))) == [(128, 224), (128, 128), (64, 128), (64, 64)]
    for func, block_n, n, last_copied in ((template_func(256, 2240, 128), 256, 2240, 2240 - 8),  # 8-column copies
                                          (k_major(256, 640, 128), 224, 640, 640 - 1)):  # a row of k per column
        kernel = wgmma_matmul.apply(func, {"block_m": 128, "block_n": block_n, "stages": 2}).mod["main"]
        assert f", {last_copied})" in cuda_source(kernel)  # B's columns past the edge: copies of its last ones
        assert f" < {n}:" in kernel.script()  # and C is stored inside its edge only (simplified per column in CUDA)


def test_the_last_row_of_tiles_may_pass_the_edge_of_c():
    # a prompt of any length: 2 x 100 rows, or 100 rows of each of a batch, in tiles of 64 or 128 rows
    assert tiles(wgmma_matmul.knob_space(template_func(200, 768, 768))) == \
        [(128, 256), (128, 192), (128, 128), (64, 256), (64, 128), (64, 64)]
    assert tiles(wgmma_matmul.knob_space(batched(2, 100, 256, 128))) == [(64, 256), (64, 128), (64, 64)]
    assert wgmma_matmul.knob_space(template_func(63, 256, 128)) == []  # less than one warpgroup's rows
    for knobs in ({"block_m": 128, "block_n": 128, "stages": 2}, {"block_m": 128, "block_n": 128, "stages": 4, "tma": 1}):
        kernel = wgmma_matmul.apply(template_func(200, 256, 128), knobs).mod["main"]
        assert "T.launch_thread(\"blockIdx.x\", 4)" in kernel.script()  # 2 rows of tiles (256 rows) by 2 columns
        assert " < 200" in kernel.script()  # C is stored inside its edge only
        if not knobs.get("tma"):  # A's rows past the edge: copies of its last one (TMA fills zeros)
            assert ", 199)" in cuda_source(kernel)
    sm_90a = tvm.target.Target(SM_90A)
    assert dispatch.heuristic_knobs(template_func(200, 768, 768), sm_90a)["strategy"] == "wgmma_matmul"


def test_only_sm_90a_targets_get_it():
    func = template_func(1024, 1024, 1024)
    assert dispatch.heuristic_knobs(func, tvm.target.Target(SM_90A))["strategy"] == "wgmma_matmul"
    assert dispatch.heuristic_knobs(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))["strategy"] == "matmul"


def test_matmuls_it_cannot_take_keep_tensor_cores_on_sm_90a():
    # symbolic rows go to dlight, whose version check reads "sm_90a" as no tensor cores: it is asked
    # on sm_90 (a dynamic-length LLaMA layer took 8.8 ms at seq 512 on CUDA cores, 3.1 with them)
    rows = tvm.tirx.Var("n", "int64")
    x, w = relax.Var("x", relax.TensorType([rows, 1024], "float16")), relax.Var("w", relax.TensorType([1024, 1024], "float16"))
    src = cuda_source_of(tvm_ext.build(main_module(lambda bb, x, w: relax.op.matmul(x, w), [x, w]), SM_90A))
    assert "wmma::mma_sync" in src and "wgmma" not in src


def test_a_full_wave_of_blocks_picks_the_tile():
    sm_90a = tvm.target.Target(SM_90A)
    assert dispatch.heuristic_knobs(template_func(4096, 4096, 4096), sm_90a)["block_n"] == 256  # 512 blocks
    small = dispatch.heuristic_knobs(template_func(512, 768, 768), sm_90a)  # BERT's attention projection
    assert (small["block_m"], small["block_n"], small["stages"]) == (64, 64, 7)  # 96 blocks, the most; two per SM
    assert small["group"] == 8  # 8 rows of tiles: blocks walk down 8 of them per column of tiles


def test_tiles_alone_on_their_sm_are_narrowed_to_fill_the_last_wave():
    sm_90a = tvm.target.Target(SM_90A)  # 132 SMs
    gate_and_up = dispatch.heuristic_knobs(k_major(512, 22016, 4096), sm_90a)  # LLaMA's joint gate and up projection
    assert (gate_and_up["block_m"], gate_and_up["block_n"]) == (128, 224)  # 396 blocks: 3 whole waves (344 of 128 x 256)
    assert dispatch.heuristic_knobs(k_major(4096, 4096, 4096), sm_90a)["block_n"] == 256  # 512 of 528: stays
    assert dispatch.heuristic_knobs(k_major(1024, 11008, 4096), sm_90a)["block_n"] == 256  # 224 would need 4 waves, not 3


def test_only_a_block_alone_on_its_sm_keeps_a_wgmma_group_in_flight():
    func = template_func(256, 512, 256)
    alone = cuda_source(wgmma_matmul.apply(func, {"block_m": 128, "block_n": 256, "stages": 4}).mod["main"])  # 192 KB
    shared = cuda_source(wgmma_matmul.apply(func, {"block_m": 128, "block_n": 128, "stages": 3}).mod["main"])  # 96 KB
    assert "wgmma.wait_group.sync.aligned 1" in alone and "cp.async.wait_group 1" in alone  # 2 tiles ahead
    assert "wgmma.wait_group.sync.aligned 1" not in shared and "cp.async.wait_group 1" in shared  # 2 tiles ahead


@pytest.mark.parametrize("n_major", [True, False])
def test_the_cuda_is_warpgroup_mma_from_swizzled_shared_memory(n_major):
    func = template_func(256, 512, 256) if n_major else k_major(256, 512, 256)
    src = cuda_source(wgmma_matmul.apply(func, {"block_m": 128, "block_n": 128, "stages": 4}).mod["main"])
    assert src.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16") == 1  # one helper ...
    assert src.count("_m64n128k16_f32_f16_f16_1_1_0_" + ("1(" if n_major else "0(")) == 5  # ... defined, called 4x
    for needed in ("wgmma.fence.sync.aligned", "wgmma.commit_group", "wgmma.wait_group.sync.aligned 0",
                   "wgmma.wait_group.sync.aligned 1",  # one step in flight, 4 - 2 tiles copied ahead:
                   "fence.proxy.async.shared::cta", "cp.async.cg.shared.global", "cp.async.wait_group 1"):
        assert needed in src, needed
    assert "& 7) ^ " in src  # the 128-byte swizzle: a 16-byte chunk's index XOR its row's
    assert "__launch_bounds__(256)" in src  # two warpgroups for 128 rows


@pytest.mark.parametrize("n_major", [True, False])
def test_bf16_is_bf16_wgmma_from_bf16_shared_memory_and_tma_descriptors(n_major):
    func = template_func(512, 4096, 4096, "bfloat16") if n_major else k_major(512, 4096, 4096, "bfloat16")
    for knobs in ({"block_m": 128, "block_n": 256, "stages": 4, "group": 4, "tma": 1}, {"block_m": 128, "block_n": 128, "stages": 4}):
        kernel = wgmma_matmul.apply(func, knobs).mod["main"]
        script, src = kernel.script(), cuda_source(kernel)
        assert script.count('descriptor_dtype="bfloat16"') == (2 if knobs.get("tma") else 0)
        assert 'alloc_buffer((' in script and '"bfloat16", scope="shared.dyn"' in script
        assert f"wgmma.mma_async.sync.aligned.m64n{knobs['block_n']}k16.f32.bf16.bf16" in src and ".f16.f16" not in src


def test_a_bf16_linear_reads_its_weight_as_stored_on_wgmma_through_the_pipeline():
    executable = tvm_ext.build(linear_gelu(512, 768, 768, "bfloat16"), SM_90A)
    src = cuda_source_of(executable)
    assert "wgmma.mma_async.sync.aligned.m64n" in src and "k16.f32.bf16.bf16" in src
    assert any("matmul_nt" in name for name in tvm_ext.cuda_kernels(executable))  # W [n, k] read untransposed
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(SM_90A):
            assert bytes(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


def test_the_epilogue_is_computed_on_the_accumulators():
    mod = fused_module(linear_gelu(256, 512, 256), tvm.target.Target(SM_90A))
    (name, func), = [(gv.name_hint, f) for gv, f in mod.functions_items()
                     if isinstance(f, tvm.tirx.PrimFunc) and dispatch.contraction_template(f) is not None]
    src = cuda_source(wgmma_matmul.apply(func, wgmma_matmul.knob_space(func)[0]).mod["main"])
    assert "wgmma.mma_async" in src
    assert "erf" in src and "bias" in src  # GELU and the bias in the same kernel as the wgmma
    assert "float* __restrict__" not in src.split("main_kernel(")[1].split(")")[0]  # no fp32 intermediate


@pytest.mark.parametrize("n_major", [True, False])
def test_tma_kernels_load_whole_tiles_by_bulk_tensor_copies_from_a_producer_warp(n_major):
    func = template_func(512, 4096, 4096) if n_major else k_major(512, 4096, 4096)
    knobs = {"block_m": 128, "block_n": 256, "stages": 4, "group": 4, "tma": 1}
    kernel = wgmma_matmul.apply(func, knobs).mod["main"]
    host = kernel.script()  # the descriptors, encoded on the host: k then rows of A, B by 64-column atoms if n-major
    assert "T.tensormap_encode_tiled(A_tensormap, a.data, 4096, 512, 8192, 64, 128, 1, 1," in host
    assert ("(B_tensormap, b.data, 4096, 4096, 8192, 64, 64, 1, 1," if n_major else
            "(B_tensormap, w.data, 4096, 4096, 8192, 64, 256, 1, 1,") in host
    assert host.count("swizzle=3") == 2  # 128-byte swizzled, as the wgmma descriptors read the tiles
    src = cuda_source(kernel)
    assert "const __grid_constant__ CUtensorMap A_tensormap, const __grid_constant__ CUtensorMap B_tensormap" in src
    assert "__launch_bounds__(288)" in src  # two warpgroups and the producer warp
    copies = src.split("if (((int)threadIdx.x) == 256) {")[1].split("} else {")[0]
    assert copies.count("tvm_builtin_ptx_cp_async_bulk_tensor_g2s_cluster_async_bulk_tensor_2d") == (5 if n_major else 2)
    assert "(uint)49152)" in copies  # the stage's bytes, expected on its "full" barrier
    for needed in ("mbarrier.try_wait.parity", "mbarrier.arrive.shared::cta.b64", "wgmma.wait_group.sync.aligned 1"):
        assert needed in src, needed
    assert "cp.async.cg" not in src and "fence.proxy.async" not in src  # nothing copied by the threads


def test_operands_a_descriptor_cannot_describe_are_copied_by_the_threads():
    a, b = te.placeholder((1, 512, 256), "float16", name="a"), te.placeholder((256, 512), "float16", name="b")
    r = te.reduce_axis((0, 256), name="k")
    func = te.create_prim_func([a, b, te.compute(  # A's batch axis indexed by a constant, not a batch iterator
        (512, 512), lambda i, j: te.sum(a[0, i, r].astype("float32") * b[r, j].astype("float32"), axis=r), name="c")])
    space = wgmma_matmul.knob_space(func)
    assert space and not any(p.get("tma") for p in space)
    assert wgmma_matmul.apply(func, {"block_m": 128, "block_n": 256, "stages": 4, "tma": 1}) is None
    assert "tma" not in dispatch.heuristic_knobs(func, tvm.target.Target(SM_90A))


def test_tma_is_picked_for_tiles_alone_on_their_sm():
    sm_90a = tvm.target.Target(SM_90A)
    down = dispatch.heuristic_knobs(template_func(512, 4096, 11008), sm_90a)  # LLaMA-512's down projection: 128 blocks
    assert (down["block_m"], down["block_n"], down["stages"], down["tma"]) == (64, 256, 5, 1)
    assert dispatch.heuristic_knobs(template_func(4096, 4096, 4096), sm_90a)["tma"] == 1
    assert "tma" not in dispatch.heuristic_knobs(template_func(512, 768, 768), sm_90a)  # two blocks per SM: cp.async
    fc1 = dispatch.heuristic_knobs(template_func(1024, 3072, 768), sm_90a)  # BERT-128's: K = 768 is too short for 64 x 256
    assert (fc1["block_m"], fc1["block_n"], fc1.get("tma")) == (128, 128, None)


def batched(batch, m, n, k, dtype="float16"):
    """C[b] = A[b] @ B: a batch of A against one B (a linear layer on [batch, seq, hidden])."""
    a, b = te.placeholder((batch, m, k), dtype, name="a"), te.placeholder((k, n), dtype, name="b")
    r = te.reduce_axis((0, k), name="k")
    return te.create_prim_func([a, b, te.compute(
        (batch, m, n), lambda z, i, j: te.sum(a[z, i, r].astype("float32") * b[r, j].astype("float32"), axis=r), name="c")])


def test_a_batch_is_blockidx_z_and_the_tiles_walk_in_groups_of_rows():
    src = cuda_source(wgmma_matmul.apply(batched(3, 512, 256, 128), {"block_m": 64, "block_n": 128, "stages": 4,
                                                                        "group": 4}).mod["main"])
    assert "blockIdx.z" in src and "blockIdx.y" not in src  # the tiles of one matrix: one blockIdx.x


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512, 256), (128, 256, 64), (1024, 11008, 4096), (3, 512, 256, 128),
                                   (256, 2240, 128), ("k-major", 256, 640, 128), (200, 768, 768), (2, 100, 256, 128),
                                   ("k-major", 100, 640, 192)])
def test_wgmma_matmul_on_gpu(shape, rng, dtype="float16"):
    *batch, m, n, k = shape
    weight_rows = batch == ["k-major"]
    batch = [] if weight_rows else batch
    func = k_major(m, n, k, dtype) if weight_rows else batched(*shape, dtype) if batch else template_func(m, n, k, dtype)
    a = rng.standard_normal((*batch, m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    want = a.astype("float64") @ b.astype("float64")
    b = np.ascontiguousarray(b.T) if weight_rows else b
    for knobs in wgmma_matmul.knob_space(func):
        lib = tvm.compile(tvm.IRModule({"main": wgmma_matmul.apply(func, knobs).mod["main"].with_attr("global_symbol", "main")}),
                          target=tvm.target.Target(SM_90A))
        dev = tvm.cuda()
        c = tvm.runtime.tensor(np.full(want.shape, np.nan, "float32"), dev)
        lib["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c)
        err = np.abs(c.numpy() - want).max() / np.abs(want).max()
        assert err < 1e-3, (knobs, err)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512, 256), ("k-major", 100, 640, 192), (2, 100, 256, 128)])
def test_bf16_wgmma_matmul_on_gpu(shape, rng):
    test_wgmma_matmul_on_gpu(shape, rng, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_gelu_through_the_pipeline_on_gpu(dtype, rng):
    m, n, k = 512, 768, 768
    x, w = rng.standard_normal((m, k)).astype(dtype), (rng.standard_normal((n, k)) / 16).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    executable = tvm_ext.build(linear_gelu(m, n, k, dtype), SM_90A)
    assert "wgmma.mma_async" in cuda_source_of(executable)
    dev = tvm.cuda()
    got = VirtualMachine(executable, dev)["main"](*[tvm.runtime.tensor(v, dev) for v in (x, w, bias)]).numpy()
    y = (x.astype("float32") @ w.astype("float32").T).astype(dtype).astype("float32") + bias.astype("float32")
    want = 0.5 * y * (1 + np.vectorize(math.erf)(y / np.sqrt(2)))
    tolerance = 2e-2 if dtype == "float16" else 8e-2  # bf16's 8 mantissa bits: an ulp is 0.8% at 1
    np.testing.assert_allclose(got.astype("float32"), want, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 77])
def test_every_point_storing_through_shared_memory_after_a_deep_k_on_gpu(m, rng):
    """fp16 results staged through shared memory after 64 steps of k (a 64 x 64 tile of 8 stages
    loaded by cp.async stored wrong sums: wgmma_matmul._wrong_when_copied)."""
    n, k = 1024, 4096
    func = next(f for gv, f in fused_module(linear_gelu(m, n, k), tvm.target.Target(SM_90A)).functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint)
    x, w = rng.standard_normal((m, k)).astype("float16"), (rng.standard_normal((n, k)) / 16).astype("float16")
    bias = rng.standard_normal(n).astype("float16")
    y = (x.astype("float32") @ w.astype("float32").T).astype("float16").astype("float32") + bias.astype("float32")
    want = 0.5 * y * (1 + np.vectorize(math.erf)(y / np.sqrt(2)))
    dev = tvm.cuda()
    points = wgmma_matmul.knob_space(func)
    eight = {"strategy": "wgmma_matmul", "block_m": 64, "block_n": 64, "stages": 8, "group": wgmma_matmul._group(m, 64)}
    assert eight not in points and {**eight, "tma": 1} in points and wgmma_matmul.apply(func, eight) is None
    for knobs in points:
        lib = tvm.compile(tvm.IRModule({"main": wgmma_matmul.apply(func, knobs).mod["main"].with_attr("global_symbol", "main")}),
                          target=tvm.target.Target(SM_90A))
        out = tvm.runtime.tensor(np.full((m, n), np.nan, "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(v, dev) for v in (x, w, bias)], out)
        np.testing.assert_allclose(out.numpy().astype("float32"), want, atol=2e-2, rtol=2e-2, err_msg=str(knobs))


def test_on_sm_90a_the_tuner_searches_the_wgmma_points_and_records_of_the_other_template_give_way():
    from tvm_ext.search.features import NAMES, candidate_features  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415

    func, sm_90a = template_func(2048, 1024, 512), tvm.target.Target(SM_90A)
    points = knob_space(func, sm_90a)
    assert {p["strategy"] for p in points} == {"wgmma_matmul"} and points[0] == dispatch.heuristic_knobs(func, sm_90a)
    column = dict(zip(NAMES, candidate_features(func, points, sm_90a).T))
    assert (column["is_matmul"] == 1).all() and set(column["pipeline_stages"]) == {p["stages"] for p in points}
    assert dispatch.schedule(func, sm_90a, matmul.default_knobs()).mod["main"].script().count("wgmma") > 0  # an sm_90 record
    assert "wgmma" not in dispatch.schedule(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
                                            points[0]).mod["main"].script()  # and the other way round
