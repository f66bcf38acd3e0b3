"""The vectorised elementwise rule: what it takes, the code it writes, and the GPU."""

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.support import nvcc

import tvm_ext
from bench.spelled import main_module
from conftest import CUDA_TARGET
from helpers import kernel_bodies
from tvm_ext.schedules import elementwise
from tvm_ext.introspect import cuda_source

op = relax.op


def scale_shift_relu(shape=(8, 64, 28, 28), dtype="float32"):
    """relu(x * scale[c] + shift[c]): inference batch norm, folded, with its ReLU."""
    x = relax.Var("x", relax.TensorType(list(shape), dtype))
    s, b = (relax.Var(n, relax.TensorType([1, shape[1], 1, 1], dtype)) for n in "sb")
    return main_module(lambda bb, x, s, b: op.nn.relu(op.add(op.multiply(x, s), b)), [x, s, b])


def swiglu(rows=64, cols=512):
    """silu(gate) * up in fp16 computed in float32, as LLaMA's MLP spells it."""
    g, u = (relax.Var(n, relax.TensorType([rows, cols], "float16")) for n in "gu")
    return main_module(lambda bb, g, u: op.multiply(op.astype(op.nn.silu(op.astype(g, "float32")), "float16"), u), [g, u])


def _only_func(mod):
    mod = relax.transform.LegalizeOps()(mod)
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(mod)))
    return next(f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def test_broadcast_inputs_and_casts_are_taken_a_transpose_is_not():
    assert elementwise.apply(_only_func(scale_shift_relu())) is not None
    assert elementwise.apply(_only_func(swiglu())) is not None
    x = relax.Var("x", relax.TensorType([64, 128], "float32"))
    assert elementwise.apply(_only_func(main_module(lambda bb, x: op.permute_dims(x, [1, 0]), [x]))) is None
    y = relax.Var("y", relax.TensorType([64, 30], "float32"))  # 30 columns: no whole 4-lane vectors
    assert elementwise.apply(_only_func(main_module(lambda bb, y: op.nn.relu(y), [y]))) is None


@pytest.mark.parametrize("mod, vector", [(scale_shift_relu(), "float4"), (swiglu(), "half4")], ids=["bn-relu", "swiglu"])
def test_the_pipeline_writes_vector_loads_and_stores(mod, vector):
    source = cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    assert f"__launch_bounds__({elementwise.THREADS})" in source and f"*({vector}*)" in source
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(CUDA_TARGET):
            assert bytes(nvcc.compile_cuda(source, target_format="cubin", compiler="nvcc")[:4]) == b"\x7fELF"


@pytest.mark.gpu
def test_vectorised_elementwise_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    x = rng.standard_normal((8, 64, 28, 28)).astype("float32")
    s, b = (rng.standard_normal((1, 64, 1, 1)).astype("float32") for _ in range(2))
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(scale_shift_relu(), "cuda"), dev)["main"](
        *[tvm.runtime.tensor(a, dev) for a in (x, s, b)]).numpy()
    np.testing.assert_allclose(out, np.maximum(x * s + b, 0), rtol=1e-6, atol=1e-6)


def merge_heads(batch=2, heads=12, seq=16, head_dim=64):
    """Attention's output [batch * heads, seq, head_dim] -> [batch * seq, heads * head_dim], as the
    frontend writes `a.transpose(1, 2).reshape(b, n, hidden)`: reshape, transpose, reshape."""
    a = relax.Var("a", relax.TensorType([batch * heads, seq, head_dim], "float16"))
    return main_module(lambda bb, a: op.reshape(op.permute_dims(op.reshape(a, [batch, heads, seq, head_dim]), [0, 2, 1, 3]),
                                                [batch * seq, heads * head_dim]), [a])


def test_a_head_merge_is_taken_when_vectors_stay_inside_a_head():
    """Its input index is `v % 64` of the output's innermost axis v: a 4-lane vector starting at a
    multiple of 4 stays inside one head's 64 contiguous elements (BERT's merge at seq 512 ran at
    1.3 TB/s on dlight's fallback). With 6-wide heads a vector would straddle two heads."""
    source = cuda_source(tvm_ext.build(merge_heads(), CUDA_TARGET))
    assert f"__launch_bounds__({elementwise.THREADS})" in source and source.count("*(half4*)") == 2  # load, store
    assert elementwise.apply(_only_func(merge_heads(head_dim=6))) is None


def rotate_half(rows=64, width=128):
    """A rotary embedding's rotate_half: the two halves of each row swapped, the first negated."""
    x = relax.Var("x", relax.TensorType([rows, width], "float16"))
    half = lambda lo, hi: op.strided_slice(x, axes=[1], begin=[lo], end=[hi])  # noqa: E731
    return main_module(lambda bb, x: op.concat([op.negative(half(width // 2, width)), half(0, width // 2)], axis=1), [x])


def test_a_choice_per_lane_takes_four_elements_a_block_apart():
    """rotate_half picks its input per element: TVM would loop over a vector's 4 lanes one at a time
    (strided, uncoalesced), so each thread takes 4 elements THREADS apart instead, unrolled."""
    assert "if_then_else" in _only_func(rotate_half()).script()
    source = cuda_source(tvm_ext.build(rotate_half(), CUDA_TARGET))
    assert f"__launch_bounds__({elementwise.THREADS})" in source and "*(half4*)" not in source
    assert [f"+ {i * elementwise.THREADS})] = condval_{i};" in source for i in (1, 2, 3)] == [True] * 3


def test_a_choice_per_lane_at_a_symbolic_length_takes_rows_a_thread_its_elements_a_row_apart():
    """At a symbolic length the row index is split once per thread (not per element, dividing by
    the symbolic extents), and a thread's 4 elements lie 32 apart in its row: each half of
    rotate_half, known when the kernel is written."""
    seq = tvm.tirx.Var("seq", "int64")
    bodies = kernel_bodies(cuda_source(tvm_ext.build(rotate_half(seq), CUDA_TARGET)))
    assert bodies and all("condval" not in body and body.count("T_concat_intermediate_ptr[") == elementwise.LANES
                          and " % " not in body and " / " not in body for body in bodies.values()), bodies


@pytest.mark.gpu
def test_a_symbolic_rotate_half_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    dev = tvm.cuda()
    main = VirtualMachine(tvm_ext.build(rotate_half(tvm.tirx.Var("seq", "int64")), "cuda"), dev)["main"]
    for rows in (1, 7, 300):
        x = rng.standard_normal((rows, 128)).astype("float16")
        np.testing.assert_array_equal(main(tvm.runtime.tensor(x, dev)).numpy(), np.concatenate([-x[:, 64:], x[:, :64]], axis=1))


@pytest.mark.gpu
def test_a_head_merge_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    a = rng.standard_normal((24, 16, 64)).astype("float16")
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(merge_heads(), "cuda"), dev)["main"](tvm.runtime.tensor(a, dev)).numpy()
    np.testing.assert_array_equal(out, a.reshape(2, 12, 16, 64).transpose(0, 2, 1, 3).reshape(32, 768))


@pytest.mark.gpu
def test_rotate_half_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    x = rng.standard_normal((64, 128)).astype("float16")
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(rotate_half(), "cuda"), dev)["main"](tvm.runtime.tensor(x, dev)).numpy()
    np.testing.assert_array_equal(out, np.concatenate([-x[:, 64:], x[:, :64]], axis=1))


def add_scalar(shape=(32, 64), dtype="float16"):
    """x + s with s a 0-d tensor (GPT-2's attention scale, transformers' mask fill values)."""
    x, s = relax.Var("x", relax.TensorType(list(shape), dtype)), relax.Var("s", relax.TensorType([], dtype))
    return main_module(lambda bb, x, s: op.add(x, s), [x, s])


def test_a_0d_operand_is_read_once_per_vector():
    sch = elementwise.apply(_only_func(add_scalar()))
    assert sch is not None  # it raised "not enough values to unpack" on the 0-d load
    source = cuda_source(tvm_ext.build(add_scalar(), CUDA_TARGET))
    assert "*(half4*)" in source


@pytest.mark.gpu
def test_a_0d_operand_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    x, s = rng.standard_normal((32, 64)).astype("float16"), np.array(0.75, "float16")
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(add_scalar(), "cuda"), dev)["main"](tvm.runtime.tensor(x, dev),
                                                                           tvm.runtime.tensor(s, dev)).numpy()
    np.testing.assert_array_equal(out, x + s)


def mask_to_bool(shape=(2, 64)):
    """transformers' `attention_mask.bool()`: an int64 mask cast to bool."""
    m = relax.Var("m", relax.TensorType(list(shape), "int64"))
    return main_module(lambda bb, m: op.astype(m, "bool"), [m])


def test_bool_outputs_are_stored_one_lane_at_a_time():
    """A 4-lane bool store was printed as one 8-byte ushort4 at 4-byte steps: a misaligned-address fault."""
    source = cuda_source(tvm_ext.build(mask_to_bool(), CUDA_TARGET))
    assert "ushort4" not in source and "bool4" not in source
    assert elementwise.apply(_only_func(mask_to_bool())) is not None  # still ours: LANES per thread, unrolled


@pytest.mark.gpu
def test_bool_outputs_are_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    m = rng.integers(0, 2, (2, 64)).astype("int64")
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(mask_to_bool(), "cuda"), dev)["main"](tvm.runtime.tensor(m, dev)).numpy()
    np.testing.assert_array_equal(out, m.astype(bool))


def cache_append(dtype="float16"):
    """A KV cache grown by one position: concat([batch, heads, past, 128], [batch, heads, 1, 128]) along
    the positions, batch and past symbolic."""
    batch, past = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("past", "int64")
    cache = relax.Var("cache", relax.TensorType([batch, 4, past, 128], dtype))
    new = relax.Var("new", relax.TensorType([batch, 4, 1, 128], dtype))
    return main_module(lambda bb, cache, new: op.concat([cache, new], axis=2), [cache, new])


@pytest.mark.parametrize("dtype, vector", [("float16", "half4"), ("float32", "float4")])
def test_symbolic_rows_take_a_vector_per_thread(dtype, vector):
    """With a symbolic outer extent the fused index is split by divisions: once per thread's
    ROW_VECTORS vectors of a row, not once per element (4 half elements a thread, looped one at a
    time), and in 32 bits where the sizes allow (an int32 twin chosen per call)."""
    source = cuda_source(tvm_ext.build(cache_append(dtype), CUDA_TARGET))
    assert f"__launch_bounds__({elementwise.THREADS})" in source and f"*({vector}*)" in source
    bodies = kernel_bodies(source)
    assert set(bodies) == {"concatenate_kernel", "concatenate_i32_kernel"}
    for body in bodies.values():
        assert "for (" not in body  # no loop over a thread's lanes
        assert body.count(f"*({vector}*)(T_concat_ptr") == elementwise.ROW_VECTORS


def test_a_symbolic_squeezed_slice_builds():
    """BERT's q of its packed projection at a symbolic length, [3, 2, 4, seq, 32] sliced at 1 and
    squeezed: with 8-lane half vectors CUDA codegen failed (and the build with it)."""
    seq = tvm.tirx.Var("seq", "int64")
    x = relax.Var("x", relax.TensorType([3, 2, 4, seq, 32], "float16"))
    mod = main_module(lambda bb, x: op.squeeze(op.strided_slice(x, axes=[0], begin=[1], end=[2]), [0]), [x])
    assert "*(half4*)" in cuda_source(tvm_ext.build(mod, CUDA_TARGET))


@pytest.mark.gpu
def test_a_symbolic_cache_append_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    dev = tvm.cuda()
    main = VirtualMachine(tvm_ext.build(cache_append(), "cuda"), dev)["main"]
    for batch, past in ((1, 1), (3, 77), (2, 4095)):
        cache = rng.standard_normal((batch, 4, past, 128)).astype("float16")
        new = rng.standard_normal((batch, 4, 1, 128)).astype("float16")
        out = main(tvm.runtime.tensor(cache, dev), tvm.runtime.tensor(new, dev)).numpy()
        np.testing.assert_array_equal(out, np.concatenate([cache, new], axis=2))
