"""Reduce-centric fusion: spelled-out norms become one kernel, round where the model rounds, and
leave what they do not understand (a matmul) to TVM."""

import shutil
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine
from tvm.support import nvcc

import tvm_ext
from barriers import divergent_barriers
from bench import spelled
from conftest import CUDA_TARGET

KERNELS = {  # ours (TVM's default pipeline's counts are printed beside them)
    "rms_norm_llama": 1, "layer_norm_spelled": 1, "softmax_spelled": 1, "layer_norm_gelu": 1, "add_rms_norm": 1,
    "rms_norm_silu": 1,
}


def kernels(executable) -> list:
    """Device kernels, an int32 twin counted with its original."""
    return sorted({k.replace("_i32_kernel", "_kernel") for k in tvm_ext.cuda_kernels(executable)})


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("shape", [[256, 1024], ["n", 4096], [1, 4096]])  # [1, n]: one row, a decoding step
def test_one_kernel_per_spelled_out_pattern(name, shape, capsys):
    mod = spelled.module(name, shape, "float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a template falling back to TVM would warn
        ours = kernels(tvm_ext.build(mod, CUDA_TARGET))
    theirs = tvm_ext.cuda_kernels(tvm.compile(mod, target=tvm_ext.parse_target(CUDA_TARGET)))
    with capsys.disabled():
        print(f"\n  {name} {shape}: tvm_ext {len(ours)} kernel(s), TVM default {len(theirs)}")
    # a Welford LayerNorm over a symbolic row count: a kernel for fewer rows than SMs too
    assert len(ours) == KERNELS[name] + (name == "layer_norm_gelu" and shape == ["n", 4096]), ours
    if name != "layer_norm_gelu":  # TVM already fuses a norm op with what follows it
        assert len(theirs) > len(ours)


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numerics_round_where_the_model_rounds(name, dtype, rng):
    shape = [33, 700]
    mod = spelled.module(name, shape, dtype)
    arrays = spelled.inputs(name, shape, dtype, rng)
    vm = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    got = [g.numpy() for g in got] if isinstance(got, (list, tuple)) or hasattr(got, "__len__") and not hasattr(
        got, "numpy") else [got.numpy()]
    want = spelled.reference(name, arrays)
    tolerance = 2e-3 if dtype == "float16" else 1e-5
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.astype("float32"), w, rtol=tolerance, atol=tolerance)


def test_a_matmul_is_left_to_tvm_and_the_norm_after_it_still_fuses(rng):
    bb = relax.BlockBuilder()
    x, m = relax.Var("x", relax.TensorType([64, 256], "float32")), relax.Var("m", relax.TensorType([256, 512], "float32"))
    w = relax.Var("w", relax.TensorType([512], "float32"))
    with bb.function("main", [x, m, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, m))
            out = bb.emit_output(spelled.rms_norm_llama(bb, y, w))
        bb.emit_func_output(out)
    mod = bb.get()
    names = kernels(tvm_ext.build(mod, CUDA_TARGET))
    assert len(names) == 2 and sum("matmul" in k for k in names) == 1, names
    xs, ms, ws = (rng.standard_normal(s).astype("float32") for s in ([64, 256], [256, 512], [512]))
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](*map(tvm.runtime.tensor, (xs, ms, ws))).numpy()
    y = xs @ ms
    np.testing.assert_allclose(got, y / np.sqrt((y ** 2).mean(-1, keepdims=True) + spelled.EPS) * ws, rtol=1e-4, atol=1e-4)


def test_the_scale_and_causal_mask_before_an_attention_softmax_join_its_kernel(rng):
    """Attention scores come out of a batched matmul as [heads, n, n], are reshaped to [1, heads, n, n],
    scaled and masked: a reshape FuseOps keeps apart from the softmax (on the H200 that kernel took
    2.7x the softmax's time in a LLaMA layer at seq 2048). Read by nothing else, it joins."""
    heads, n = 4, 64
    scores, mask = relax.Var("s", relax.TensorType([heads, n, n], "float16")), relax.Var("m", relax.TensorType([n, n], "float16"))
    mod = spelled.main_module(lambda bb, s, m: relax.op.astype(relax.op.nn.softmax(relax.op.astype(relax.op.add(
        relax.op.divide(relax.op.reshape(s, [1, heads, n, n]), relax.const(8.0, "float16")), m), "float32")), "float16"),
        [scores, mask])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = kernels(tvm_ext.build(mod, CUDA_TARGET))
    assert len(names) == 1 and "reshape" in names[0] and "softmax" in names[0], names
    s = rng.standard_normal([heads, n, n]).astype("float16")
    m = np.triu(np.full([n, n], -np.inf, "float32"), 1).astype("float16")
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(s), tvm.runtime.tensor(m)).numpy()
    z = (s.astype("float32") / 8 + m.astype("float32"))[None]
    want = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(got.astype("float32"), want / want.sum(-1, keepdims=True), atol=1e-3)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_fused_kernels_compile_and_keep_barriers_out_of_divergent_branches(name):
    src = tvm_ext.cuda_source(tvm_ext.build(spelled.module(name, [512, 2048], "bfloat16"), CUDA_TARGET))
    assert divergent_barriers(src) == []
    if shutil.which("nvcc"):
        with tvm_ext.parse_target(CUDA_TARGET):
            assert len(nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")) > 1000


def test_reductions_over_other_axes_are_not_merged(rng):
    """LayerNorm over rows, then softmax over columns of the square result: two kernels, right numbers."""
    bb = relax.BlockBuilder()
    x, g, b = (relax.Var(n, relax.TensorType(s, "float32")) for n, s in (("x", [256, 256]), ("g", [256]), ("b", [256])))
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=spelled.EPS))
            out = bb.emit_output(relax.op.nn.softmax(h, axis=0))
        bb.emit_func_output(out)
    mod = bb.get()
    assert len(kernels(tvm_ext.build(mod, CUDA_TARGET))) == 2
    xs, gs, bs = (rng.standard_normal(s).astype("float32") for s in ([256, 256], [256], [256]))
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](*map(tvm.runtime.tensor, (xs, gs, bs))).numpy()
    h = (xs - xs.mean(-1, keepdims=True)) / np.sqrt(xs.var(-1, keepdims=True) + spelled.EPS) * gs + bs
    e = np.exp(h - h.max(0, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(0, keepdims=True), rtol=1e-4, atol=1e-6)


def test_a_transposed_input_is_copied_before_the_norm_reads_rows(rng):
    """A patch embedding's flatten(2).transpose(1, 2) before a LayerNorm (CLIP, Swin): fused, the norm
    would read its rows down columns and fall back to TVM; kept apart, the norm is ours."""
    bb = relax.BlockBuilder()
    x, g, b = (relax.Var(n, relax.TensorType(s, "float16")) for n, s in (("x", [2, 256, 4, 4]), ("g", [256]), ("b", [256])))
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            rows = bb.emit(relax.op.permute_dims(relax.op.reshape(x, [2, 256, 16]), [0, 2, 1]))
            out = bb.emit_output(relax.op.nn.layer_norm(rows, g, b, axes=[-1], epsilon=spelled.EPS))
        bb.emit_func_output(out)
    mod = bb.get()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal (TVM's schedule for the norm) warns
        names = kernels(tvm_ext.build(mod, CUDA_TARGET))
    assert len(names) == 2 and any("transpose" in k and "norm" not in k for k in names), names
    xs, gs, bs = (rng.standard_normal(s).astype("float16") for s in ([2, 256, 4, 4], [256], [256]))
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](*map(tvm.runtime.tensor, (xs, gs, bs))).numpy()
    r = xs.astype("float32").reshape(2, 256, 16).transpose(0, 2, 1)
    want = (r - r.mean(-1, keepdims=True)) / np.sqrt(r.var(-1, keepdims=True) + spelled.EPS) * gs + bs
    np.testing.assert_allclose(got.astype("float32"), want, atol=2e-2)


def test_a_weight_held_as_a_constant_is_passed_in(rng):
    """Imported models hold weights as tensor constants, which FuseTIR refuses inside a group."""
    weight = rng.random(512).astype("float32") + 0.5
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([64, 512], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(spelled.rms_norm_llama(bb, x, relax.const(weight)))
        bb.emit_func_output(out)
    mod = bb.get()
    assert len(kernels(tvm_ext.build(mod, CUDA_TARGET))) == 1
    xs = rng.standard_normal((64, 512)).astype("float32")
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(xs)).numpy()
    np.testing.assert_allclose(got, xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + spelled.EPS) * weight,
                               rtol=1e-5, atol=1e-6)


def top1_softmax(use_indices: bool):
    """softmax with the max spelled as PyTorch's frontend imports x.max(-1, keepdim=True)[0]."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([64, 1000], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            top = bb.emit(relax.op.topk(x, k=1, axis=-1, ret_type="both", largest=True, dtype="int64"))
            values = bb.emit(relax.TupleGetItem(top, 0))
            e = bb.emit(relax.op.exp(relax.op.subtract(x, values)))
            y = relax.op.divide(e, relax.op.sum(e, axis=[-1], keepdims=True))
            out = bb.emit_output(relax.Tuple([y, relax.TupleGetItem(top, 1)]) if use_indices else y)
        bb.emit_func_output(out)
    return bb.get()


def test_a_top1_sort_read_for_its_values_is_a_max_and_fuses(rng):
    mod = top1_softmax(use_indices=False)
    assert kernels(tvm_ext.build(mod, CUDA_TARGET)) == ["fused_max_subtract_tir_exp_sum_divide_kernel"]
    xs = rng.standard_normal((64, 1000)).astype("float32")
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(xs)).numpy()
    e = np.exp(xs - xs.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    with_indices = kernels(tvm_ext.build(top1_softmax(use_indices=True), CUDA_TARGET))
    assert any("topk" in k for k in with_indices)  # the indices are used: the sort stays


SINGLE_OP = {"rms_norm": "rms_norm_llama", "layer_norm": "layer_norm_spelled", "softmax": "softmax_spelled"}


def test_spelled_forms_get_the_single_ops_schedules_on_the_suite():
    """What lets a spelled-out norm run as fast as the op: the same strategy and knobs on every shape."""
    from bench.suite import load_suite, relax_module  # noqa: PLC0415

    from tvm_ext import schedules  # noqa: PLC0415
    from tvm_ext.pipeline import fused_reduce_functions  # noqa: PLC0415

    target = tvm_ext.parse_target({"tag": "nvidia/nvidia-h100", "arch": "sm_90"})
    # the kernel for many rows of each function (the op's Welford state alone gets a few-row class)
    plans = lambda mod: [k for f in fused_reduce_functions(mod, target).values()  # noqa: E731
                         for cond, k in schedules.plan(f, target) if " < " not in str(cond)]
    cases = [c for c in load_suite() if c["op"] in SINGLE_OP]
    assert len(cases) == 17
    for case in cases:
        op = plans(relax_module(case["op"], case["shape"], case["dtype"]))
        assert op and op == plans(spelled.module(SINGLE_OP[case["op"]], case["shape"], case["dtype"])), case["id"]


def test_a_bool_mask_in_a_fused_softmax_is_never_read_as_a_vector(rng):
    """TVM 0.27 prints a 4-lane bool load as a `ushort4` read of a byte array: wrong bytes, and a
    misaligned-address fault (our LLaMA layer at seq 512 on the H200, where the causal mask is a
    folded bool constant). Vector loops read it as bytes instead (tvm_ext.tir.bool_vectors)."""
    import re  # noqa: PLC0415

    n = 256
    scores, mask = relax.Var("s", relax.TensorType([8, n, n], "float16")), relax.Var("m", relax.TensorType([n, n], "bool"))
    mod = spelled.main_module(lambda bb, s, m: relax.op.astype(relax.op.nn.softmax(relax.op.astype(relax.op.where(
        m, relax.const(float("-inf"), "float16"), s), "float32")), "float16"), [scores, mask])
    source = tvm_ext.cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    flags = set(re.findall(r"bool\* __restrict__ (\w+)", source))
    assert flags and "half4" in source and "signed char*)" in source  # still four at a time, as bytes
    assert not [f for f in flags if re.search(r"\*\(\w+\*\)\(" + f, source)], "a bool buffer is read as a vector"
    s = rng.standard_normal([8, n, n]).astype("float16")
    m = np.triu(np.ones([n, n], bool), 1)
    got = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(s), tvm.runtime.tensor(m)).numpy()
    z = np.where(m, -np.inf, s.astype("float32"))
    want = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(got.astype("float32"), want / want.sum(-1, keepdims=True), atol=1e-3)
