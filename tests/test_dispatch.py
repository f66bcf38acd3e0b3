"""The heuristic's choices for a table of shapes, and what each choice looks like in CUDA."""

import re
import warnings

import pytest
import tvm_ffi
from tvm import relax, tirx

from tvm_ext import schedules
import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from tvm_ext.schedules import warp_row
from tvm_ext.schedules.analysis import match
from tvm_ext.schedules.device import Device, device_of
from tvm_ext.schedules.dispatch import in_vectors
from tvm_ext.schedules.grid_reduce import joint_allocation
from tvm_ext.schedules.rows import REGISTERS
from tvm_ext.pipeline import fused_reduce_functions

TARGET = tvm_ext.parse_target(CUDA_TARGET)


def plans(op, shape, dtype):
    return {name: schedules.plan(f, TARGET) for name, f in fused_reduce_functions(relax_module(op, shape, dtype), TARGET).items()}


@pytest.mark.parametrize("op, shape, dtype, expected", [
    # Welford's state: four vectors or more a lane (at least 8 lanes), 2 KB of rows a block; softmax keeps
    # a vector a lane, 128 threads
    ("layer_norm", [16384, 384], "float16", {"strategy": "warp_row", "group": 8, "rows_per_block": 4, "cache": True}),
    ("layer_norm", [32768, 768], "float16", {"strategy": "warp_row", "group": 16, "rows_per_block": 2, "cache": True}),
    ("layer_norm", [8192, 1000], "float16", {"strategy": "warp_row", "group": 16, "rows_per_block": 2}),  # a tail chunk
    ("layer_norm", [49152, 1024], "float16", {"strategy": "warp_row", "group": 32, "rows_per_block": 1}),
    # a lane's share of 80 bytes or less: kept in its registers, 4 halves at a time (its epilogue's stores)
    ("layer_norm", [65536, 256], "float16", {"strategy": "warp_row", "group": 8, "rows_per_block": 4, "vec": 4,
                                             "cache": REGISTERS}),
    ("layer_norm", [131072, 128], "float16", {"strategy": "warp_row", "group": 8, "rows_per_block": 8}),
    # fewer blocks than SMs: a row a block
    ("layer_norm", [64, 768], "float32", {"strategy": "warp_row", "group": 32, "rows_per_block": 1}),
    ("softmax", [32, 1000], "float16", {"strategy": "warp_row", "group": 32, "rows_per_block": 1}),
    ("softmax", [65536, 256], "float16", {"strategy": "warp_row", "group": 32, "rows_per_block": 4}),
    ("softmax", [49152, 1024], "float16", {"strategy": "warp_row", "group": 32, "cache": REGISTERS}),
    ("layer_norm", [8192, 4096], "float16", {"strategy": "block_row", "threads": 128, "cache": True}),
    # staged rows of 16 KB or more: in registers at 512 lanes where the vectors stay 16 bytes (float32)
    ("softmax", [2048, 32768], "float16", {"strategy": "block_row", "threads": 1024, "vec": 8, "cache": True}),
    ("layer_norm", [8192, 4096], "float32", {"strategy": "block_row", "threads": 512, "vec": 4, "cache": REGISTERS}),
    ("layer_norm", [16, 4096], "float32", {"strategy": "block_row", "cache": True}),  # fewer rows than SMs: staged
    ("softmax", [256, 262144], "float32", {"strategy": "block_row", "threads": 512, "cache": False}),  # 1 MiB rows
    ("row_sum", [4096, 1000], "float32", {"strategy": "warp_row"}),
    ("row_sum", [64, 131072], "float32", {"strategy": "grid_reduce", "blocks_per_row": 4, "threads": 1024}),
    ("full_sum", [268435456], "float32", {"strategy": "grid_reduce", "blocks_per_row": 264, "threads": 1024}),
    ("col_sum", [131072, 1024], "float32", {"strategy": "column_split", "cols": 32, "lanes": 16, "splits": 33, "vec": 4}),
    ("col_sum", [262144, 64], "float32", {"strategy": "column_split", "cols": 16, "lanes": 32, "splits": 264, "vec": 4}),
    ("col_sum", [1048576, 16], "float32", {"strategy": "column_split", "cols": 4, "lanes": 128, "splits": 264, "vec": 4}),
    ("col_sum", [4096, 65536], "float32", {"strategy": "column_reduce", "cols": 16, "lanes": 64}),  # 4096 blocks
    ("col_sum", [512, 64], "float32", {"strategy": "column_reduce"}),  # too few rows to share
])
def test_heuristic_choice(op, shape, dtype, expected):
    (plan,) = plans(op, shape, dtype).values()
    (condition, knobs), = plan
    assert condition is None and {k: knobs[k] for k in expected} == expected


def test_batch_statistics_are_one_welford_reduction_with_two_outputs():
    chosen = {name: [k["strategy"] for _, k in plan] for name, plan in plans("bn_stats", [128, 256, 56, 56], "float32").items()}
    assert chosen == {"mean_variance": ["block_row"]}  # one block per channel; x read once for both


def test_a_lone_mean_still_takes_the_grid():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([128, 256, 56, 56], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.mean(x, axis=[0, 2, 3]))
        bb.emit_func_output(out)
    (plan,) = [schedules.plan(f, TARGET) for f in fused_reduce_functions(bb.get(), TARGET).values()]
    assert [k["strategy"] for _, k in plan] == ["grid_reduce"]


def test_symbolic_width_plans_six_classes_each_with_16_and_8_byte_vector_kernels():
    (plan,) = plans("softmax", [4096, "s"], "float16").values()
    bounds = ["s <= T.int64(1024)", "s <= T.int64(4096)", "s <= T.int64(8192)", "s <= T.int64(16384)",
              "s <= T.int64(32768)", None]
    expected = []
    for bound in bounds:
        for lanes in (8, 4):
            aligned = f"s % T.int64({lanes}) == T.int64(0)"
            expected.append(aligned if bound is None else f"{bound} and {aligned}")
        # the scalar classes re-read their rows: one kernel of 256 threads serves up to 8192 columns
        # and one of 1024 threads every width past 16384
        if bound not in ("s <= T.int64(4096)", "s <= T.int64(32768)"):
            expected.append(bound or "None")
    assert [str(cond) for cond, _ in plan] == expected
    assert [k["vec"] for _, k in plan] == [8, 4, 1, 8, 4] + [8, 4, 1] * 2 + [8, 4] + [8, 4, 1]
    assert [k["strategy"] for _, k in plan] == ["warp_row"] * 2 + ["block_row"] * 14
    # widths up to 1024 no vector divides, over 4096 rows (too few to fill the device four times at 128
    # lanes a row): a block of 128 lanes a row
    assert [k.get("threads") for _, k in plan][2:] == [128] + [256] * 5 + [512] * 3 + [1024] * 5
    # the bounded vector classes keep the row in registers (a lane's share of 1024, 4096, 8192,
    # 16384 or 32768 halves over 32, 256, 256, 512 or 1024 lanes: 64 or 128 bytes)
    assert [k["cache"] == REGISTERS for _, k in plan] == [k["vec"] > 1 and k["max_extent"] is not None for _, k in plan]


@pytest.mark.parametrize("rows, scalar", [(8447, "block_row"), (8448, "warp_row")])
def test_widths_no_vector_divides_take_a_block_a_row_over_rows_too_few_to_fill_the_device(rows, scalar):
    # the device's resident threads four times over at 128 lanes a row: 4 * 132 * 2048 / 128 rows
    assert 4 * device_of(TARGET).sm_count * device_of(TARGET).threads_per_sm // 128 == 8448
    (plan,) = plans("softmax", [rows, "s"], "float16").values()
    (knobs,) = [k for cond, k in plan if str(cond) == "s <= T.int64(1024)"]
    assert knobs["strategy"] == scalar and knobs["vec"] == 1 and knobs["cache"] is False
    # a symbolic row count: both, chosen per call by the count
    (plan,) = plans("rms_norm", ["b", "s"], "float16").values()
    scalar_classes = [(str(cond), k["strategy"]) for cond, k in plan if k["vec"] == 1 and k["max_extent"] == 1024]
    assert scalar_classes == [("s <= T.int64(1024) and b < T.int64(8448)", "block_row"),
                              ("s <= T.int64(1024)", "warp_row")]


def test_a_symbolic_row_count_gets_a_kernel_for_fewer_rows_than_sms():
    """A LayerNorm over [n, 4096] or [b, s, 8192]: fewer rows than SMs (a decoding step) take
    block_row's few-row block, one or two 16-byte vectors a lane, the rest its bandwidth block (rows of
    16 KB: kept in registers). RMSNorm (no
    Welford state) and rows warp_row takes pick alike for both: one kernel."""
    sm_count = device_of(TARGET).sm_count
    for shape, rows in ((["n", 4096], "n"), (["b", "s", 8192], "b * s")):
        (plan,) = plans("layer_norm", shape, "float16").values()
        assert [str(cond) for cond, _ in plan] == [f"{rows} < T.int64({sm_count})", "None"]
        (_, few), (_, many) = plan
        assert few["threads"] * few["vec"] >= shape[-1] // 2 and few["cache"] is True  # staged
        assert many["threads"] < few["threads"] or many["cache"] == REGISTERS  # 16 KB rows: registers
    for op, shape in (("rms_norm", ["n", 4096]), ("layer_norm", ["n", 1024]), ("softmax", ["n", 4096])):
        (plan,) = plans(op, shape, "float16").values()
        assert [cond for cond, _ in plan] == [None], (op, shape)


def test_vector_width_classes_follow_the_narrowest_input():
    (plan,) = plans("softmax", ["b", "s"], "float32").values()
    # 16 and 8 bytes of float32; a symbolic row count splits the first scalar class by it
    assert [k["vec"] for _, k in plan] == [4, 2, 1, 1, 4, 2] + [4, 2, 1] * 2 + [4, 2] + [4, 2, 1]
    (plan,) = plans("layer_norm", ["b", "s"], "bfloat16").values()
    assert [k["vec"] for _, k in plan] == [8, 4, 1, 1, 8, 4] + [8, 4, 1] * 2 + [8, 4] + [8, 4, 1]


def test_a_symbolic_width_is_split_into_whole_vectors_without_a_tail_test():
    # the vector class serves only widths that are a multiple of 8, and takes the width as a count
    # of vectors: no chunk is partial, so its lane loop carries no predicate and its stores vectorize
    (func,) = fused_reduce_functions(relax_module("softmax", [4096, "s"], "float16"), TARGET).values()
    (_, knobs, vector), _, (_, _, scalar) = schedules.scheduled(func, TARGET)[:3]
    assert knobs["vec"] == 8
    vector_text, scalar_text = vector.mod["main"].script(), scalar.mod["main"].script()
    # rows in registers: the width spelled with the class's bound, 1024 halves (128 vectors)
    assert '"T.min(s_vectors, T.int64(128)) * T.int64(8)"' in vector_text and "s_vectors: T.int64" in vector_text
    assert "T.vectorized(" in vector_text and "T.vectorized" not in scalar_text
    count = r"(s_vectors|T\.min\(s_vectors, T\.int64\(\d+\)\))"
    wheres = re.findall(r"T\.where\((.*)\)", vector_text)
    assert wheres and all(re.search(rf"(_0_1 < {count}|< {count} \* T\.int64\(\d+\)|- s_vectors < T\.int64\(0\))$", w)
                          for w in wheres), "the vector class tests whole chunks against the width, never an element"
    assert re.findall(r"T\.where\(.* < s\)", scalar_text)  # the scalar class tests each element


@pytest.mark.parametrize("op, dtype, vectors", [("rms_norm", "float16", {8: "uint4", 4: "half4"}),
                                                ("softmax", "float32", {4: "float4", 2: "float2"}),
                                                ("layer_norm", "bfloat16", {8: "uint4", 4: "nv_bfloat164"})])
def test_a_width_class_of_whole_vectors_loads_vectors(op, dtype, vectors):
    # the kernel takes the width in vectors (the call passes s // 8 or s // 4), so TVM knows each row
    # starts on a whole vector: the epilogue's loads of x are vectors, not gathers of elements, and
    # the reductions load a 16-byte (or, in the 8-byte classes, 8-byte) vector a chunk (LayerNorm's
    # Welford too: its pivot, the row's first element, is loaded apart)
    ex = tvm_ext.build(relax_module(op, ["b", "s"], dtype), CUDA_TARGET)
    src = tvm_ext.cuda_source(ex)
    kernels = {name: re.search(rf"void __launch_bounds__\(\d+\) {name}\(([^)]*)\) \{{(.*?)\n\}}", src, re.S).groups()
               for name in tvm_ext.cuda_kernels(ex)}
    (plan,) = plans(op, ["b", "s"], dtype).values()  # kernels _v0, _v1, ... in plan order
    lanes = {i: knobs["vec"] for i, (_, knobs) in enumerate(plan) if knobs["vec"] > 1}
    in_vectors = {name: (lanes[i], body) for name, (params, body) in kernels.items()
                  if (i := int(re.search(r"_v(\d+)_", name).group(1))) in lanes}
    assert sorted(lanes.values()) == sorted(list(vectors) * 6) and len(in_vectors) == 24, \
        "the six classes' 16- and 8-byte vector kernels, each with its int32 twin"
    assert all("s_vectors" in kernels[name][0] for name in in_vectors)
    for name, (vec, body) in in_vectors.items():
        assert not re.search(r"make_(half|float|bfloat16)\d\(p0_ptr\[", body), f"{name}: x gathered element by element"
        vector = vectors[vec]
        assert re.search(rf"\*\({vector}\*\)\(p0_local_ptr \+ (\(int64_t\))?0\) = \*\({vector}\*\)\(p0_ptr \+", body), name


@pytest.mark.parametrize("knobs", [{"strategy": "block_row", "threads": 256, "vec": 8, "cache": False},
                                   {"strategy": "warp_row", "group": 32, "rows_per_block": 4, "vec": 1, "reduce_vec": 8,
                                    "cache": False}])
def test_vectors_over_a_symbolic_width_need_a_width_class(knobs):
    # only a width class's condition (s % 8 == 0) makes a vector without a tail test correct
    (func,) = fused_reduce_functions(relax_module("softmax", [4096, "s"], "float16"), TARGET).values()
    assert schedules.schedule(func, TARGET, knobs) is None
    assert schedules.schedule(func, TARGET, {**knobs, "max_extent": 1024}) is not None


def test_grid_reduce_is_one_kernel_with_an_atomic_ticket_and_zeroed_state():
    ex = tvm_ext.build(relax_module("full_sum", [268435456], "float32"), CUDA_TARGET)
    src = tvm_ext.cuda_source(ex)
    assert tvm_ext.cuda_kernels(ex) == ["sum_v0_kernel"]
    body = re.search(r"sum_v0_kernel\([^)]*\) \{(.*?)\n\}", src, re.S).group(1)
    fence, ticket = body.index("__threadfence();"), body.index("atomicAdd((&(gr_counter_ptr[")
    assert fence < ticket, "partials must be visible before the ticket is drawn"
    assert "__ldcg((&(gr_partials_ptr[" in body, "the last block reads other blocks' partials past L1"
    assert re.search(r"gr_counter_ptr\[0\] = 0;", body), "the last block leaves the counter zeroed"
    assert "__shfl_down_sync" in body
    host = ex.as_text()
    assert host.count("call  sum_v0 ") == 1 and "c[" in host.split("call  sum_v0 ")[1].splitlines()[0]


@pytest.mark.parametrize("shape", [[16384, 4096], [4096, 1024]])  # block_row, warp_row
def test_a_row_sum_reads_every_chunk_as_one_16_byte_load(shape):
    src = tvm_ext.cuda_source(tvm_ext.build(relax_module("row_sum", shape, "float32"), CUDA_TARGET))
    body = src[src.index("__global__"):]
    assert "*(float4*)(p0_ptr + " in body and "p0_ptr[" not in body


@pytest.mark.parametrize("shape, dtype, blocks", [([262144, 64], "float32", 1 * 256), ([100000, 100], "float32", 1 * 264),
                                                   ([65536, 256], "float16", 2 * 128)])
def test_column_split_is_one_kernel_of_column_tiles_times_row_splits_with_a_ticket(shape, dtype, blocks):
    ex = tvm_ext.build(relax_module("col_sum", shape, dtype), CUDA_TARGET)
    (name,) = tvm_ext.cuda_kernels(ex)
    body = re.search(rf"{name}\([^)]*\) \{{(.*?)\n\}}", tvm_ext.cuda_source(ex), re.S).group(1)
    fence, barrier, ticket = (body.index("__threadfence();"), body.index("__syncthreads();", body.index("__threadfence();")),
                              body.index("atomicAdd((&(cs_counter_ptr["))
    assert fence < barrier < ticket, "every column's partial is visible before the block draws its ticket"
    assert "__ldcg((&(cs_partials_ptr[" in body, "the last block reads the other blocks' partials past L1"
    assert re.search(r"cs_counter_ptr\[[^]]*\] = 0;", body), "the last block leaves its counter zeroed"
    assert "threadIdx.y" in body  # lanes over rows within a block
    assert re.search(r"\*\((float4|half4)\*\)\(p0_ptr \+ ", body), "four adjacent columns a load"
    host = ex.as_text()
    assert host.count(f"call  {name.removesuffix('_kernel')} ") == 1
    (func,) = fused_reduce_functions(relax_module("col_sum", shape, dtype), TARGET).values()
    (_, knobs, sch), = schedules.scheduled(func, TARGET)
    loops = []
    tvm_ffi.structural_walk(sch.mod["main"].body, (tirx.For, loops.append), order="pre")
    extents = [int(loop.extent) for loop in loops
               if loop.thread_binding is not None and loop.thread_binding.thread_tag == "blockIdx.x"]
    assert knobs["strategy"] == "column_split" and set(extents) == {blocks}


def test_grid_reduce_leaves_full_row_epilogues_to_grid_sync():
    # a 37-row RMSNorm over 32k: few rows, but the scale needs every row's total first: a grid
    # barrier, not a last block; 7 blocks per row fill 259 of the 264 cooperative slots
    (plan,) = plans("rms_norm", [37, 32768], "bfloat16").values()
    assert [(k["strategy"], k["blocks_per_row"]) for _, k in plan] == [("grid_sync", 7)]


def test_joint_allocation_reproduces_cinns_example():
    # [64, 131072] on 80 SMs holding 1024 threads each: 1024-thread blocks leave SMs idle
    # (64 rows x 1 block); 256 threads x 5 blocks per row = 320 blocks fill all 320 slots
    device = Device("cuda", 1024, 32, 49152, 80, threads_per_sm=1024)
    assert joint_allocation(device, 64) == (256, 5, 1.0)
    h200 = Device("cuda", 1024, 32, 49152, 132)
    threads, per_row, used = joint_allocation(h200, 64)
    assert (threads, per_row) == (1024, 4) and used > 0.96  # 256 of 264 slots, one wave


def test_a_proposal_its_strategy_refuses_falls_through_to_the_next(monkeypatch):
    from tvm_ext.schedules import warp_row  # noqa: PLC0415

    (plan,) = plans("softmax", [4096, 1000], "float16").values()
    assert plan[0][1]["strategy"] == "warp_row"
    monkeypatch.setattr(warp_row, "apply", lambda *args: None)
    (plan,) = plans("softmax", [4096, 1000], "float16").values()
    assert [k["strategy"] for _, k in plan] == ["block_row"]


def test_attention_softmax_over_several_row_dims_builds_with_our_schedule():
    """BERT's scores (batch x heads x queries rows): a shared-memory stage of several rows spread over
    those dims could not be bound to threads, and the softmax fell back to TVM's schedule on the H200."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([8, 12, 128, 128], "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.nn.softmax(x, axis=-1)))
        bb.emit_func_output(y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels = tvm_ext.cuda_kernels(tvm_ext.build(bb.get(), CUDA_TARGET))
    assert len(kernels) == 1 and "softmax" in kernels[0]


@pytest.mark.parametrize("op, shape", [("softmax", [2, 4, 100, 100]), ("softmax", [2, 2, 2, 100, 100]),
                                       ("softmax", [2, 4, "s", "s"]), ("layer_norm", [2, "s", 128])])
def test_blocks_of_rows_never_cross_a_row_dim(op, shape):
    """Scores of 100 (or `seq`) queries per head, 8 rows a block: fused over the row dims, a block's
    rows crossed from one head to the next, TVM's compute_at bounded them by every row and raised
    (BERT built for any length fell back on its softmax and LayerNorm). The innermost row dim is
    split alone, so such blocks build."""
    target = tvm_ext.parse_target(CUDA_TARGET)
    mod = relax_module(op, shape, "float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        src = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    assert "threadIdx.y" in src  # several rows a block
    func = next(iter(fused_reduce_functions(mod, target).values()))
    classes = [knobs for _, knobs in schedules.plan(func, target) if knobs["strategy"] == "warp_row"]
    assert classes
    for knobs in classes:
        # rows in registers: over the width spelled with the class's bound, as the build spells it
        registers = knobs["cache"] == REGISTERS
        spelled = in_vectors(func, match(func).reduce_extent, knobs["vec"], knobs["max_extent"]) if registers else func
        for rows in (4, 8):
            assert warp_row.apply(match(spelled), device_of(target), dict(knobs, rows_per_block=rows)) is not None
