"""Decoding attention: one query row per head over a key/value cache, split over the keys
(schedules/decode_attention.py). Which chains the pass gives it (any batch and cache length from one
build, GQA, any CUDA architecture), the polynomial fit over two symbolic dims, and (GPU) the kernels'
numbers alone and inside the decode layer of examples/torch_models.py."""

import math
import re

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_ext
from bench.spelled import main_module
from tvm_ext.relax import attention as attention_pass
from tvm_ext.relax.attention import SAMPLE_LENGTHS, _fitted, fuse_attention
from tvm_ext.schedules import decode_attention
from tvm_ext.schedules.device import device_of

SM_90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
SM_80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})


def decode_chain(batch, past, heads=4, kv_heads=2, dim=128, dtype="float16", grown=False, keys_axis=2) -> tvm.IRModule:
    """A new token's q [batch, heads, 1, dim] against the cache [batch, kv_heads, past, dim] each
    query head's keys and values repeated from its group's, spelled out as the frontend imports it.
    `grown`: the cache is first grown by the new token's key and value rows (inputs too), and
    returned with the output. `keys_axis` 1: the cache is laid out [batch, past, kv_heads, dim]."""
    group, n = heads // kv_heads, batch * heads
    keys = past + 1 if grown else past
    layout = (lambda length: [batch, kv_heads, length, dim]) if keys_axis == 2 else (lambda length: [batch, length, kv_heads, dim])
    q = relax.Var("q", relax.TensorType([batch, heads, 1, dim], dtype))
    k, v = (relax.Var(x, relax.TensorType(layout(past), dtype)) for x in "kv")
    new = [relax.Var(f"new_{x}", relax.TensorType(layout(1), dtype)) for x in "kv"] if grown else []

    def repeated(bb, x):
        x = x if keys_axis == 2 else bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
        wide = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(x, [2])), [batch, kv_heads, group, keys, dim]))
        return bb.emit(relax.op.reshape(wide, [batch, heads, keys, dim]))

    def body(bb, q, k, v, *new):
        if new:
            k, v = (bb.emit(relax.op.concat([x, x_new], axis=keys_axis)) for x, x_new in zip((k, v), new))
        kt = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(repeated(bb, k), [0, 1, 3, 2])), [n, dim, keys]))
        s = bb.emit(relax.op.matmul(bb.emit(relax.op.reshape(q, [n, 1, dim])), kt, out_dtype="float32"))
        s = bb.emit(relax.op.divide(s, relax.const(math.sqrt(dim), "float32")))
        p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s)), dtype))
        o = bb.emit(relax.op.matmul(p, bb.emit(relax.op.reshape(repeated(bb, v), [n, keys, dim])), out_dtype="float32"))
        out = relax.op.astype(o, dtype)
        return relax.Tuple([bb.emit(out), k, v]) if new else out

    return main_module(body, [q, k, v, *new])


def fused(mod, target=SM_90A) -> tvm.IRModule:
    with target:
        return fuse_attention(mod)


def calls_of(mod) -> list[str]:
    return sorted(gv.name_hint for gv in mod.get_global_vars() if gv.name_hint != "main")


@pytest.mark.parametrize("target", [SM_90A, SM_80])
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_query_row_is_split_over_the_keys_on_any_cuda_architecture(target, symbolic, dtype):
    batch, past = (tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("past", "int64")) if symbolic else (3, 300)
    after = fused(decode_chain(batch, past, dtype=dtype), target)
    assert calls_of(after) == ["fused_decode_attention", "fused_decode_attention_combine"]
    main = after["main"].script()
    assert "R.nn.softmax" not in main and "R.matmul" not in main and "R.broadcast_to" not in main
    if symbolic:  # rows are batch x heads: the combine kernel, reading the workspace alone, takes both dims
        assert "(q, k, v)" in main and "R.Tensor((batch * 4, 32, 128)" in main and "(lv1, lv2, batch, past)" in main


@pytest.mark.parametrize("keys_axis", [2, 1])
@pytest.mark.parametrize("symbolic", [False, True])
def test_the_cache_grown_by_the_new_rows_is_written_by_the_attention_kernel(symbolic, keys_axis):
    """concat(past, new) read by decoding attention: the kernel reads both parts and writes the grown
    cache once, from the first query head of each group, so no copy kernel reads the cache first."""
    batch, past = (tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("past", "int64")) if symbolic else (3, 300)
    after = fused(decode_chain(batch, past, grown=True, keys_axis=keys_axis))
    main = after["main"].script()
    assert "R.concat" not in main and "(q, k, new_k, v, new_v" in main
    grown = ("batch", "past + 1") if symbolic else ("3", "301")
    grown = f"R.Tensor(({grown[0]}, 2, {grown[1]}, 128)" if keys_axis == 2 else f"R.Tensor(({grown[0]}, {grown[1]}, 2, 128)"
    assert main.count(grown) >= 4  # 2 outputs, each returned
    kernel = after["fused_decode_attention"].script()
    assert kernel.count("_grown[") == 2 and len(re.findall(r"bx % (T.int64\()?2\)? == ", kernel)) == 2  # one writer per cache head
    assert kernel.count("k_new[") == 1 and kernel.count("v_new[") == 1


def test_a_concatenation_the_kernel_reads_only_in_part_stays_a_copy():
    """Attention reading the grown cache through a slice of its keys leaves the concatenation whole."""
    k, v, new_k, new_v = (relax.Var(x, relax.TensorType([2, 4, n, 128], "float16"))
                          for x, n in (("k", 100), ("v", 100), ("new_k", 1), ("new_v", 1)))
    q = relax.Var("q", relax.TensorType([2, 4, 1, 128], "float16"))

    def body(bb, q, k, v, new_k, new_v):
        k, v = (bb.emit(relax.op.concat([x, x_new], axis=2)) for x, x_new in ((k, new_k), (v, new_v)))
        k_part = bb.emit(relax.op.strided_slice(k, axes=[2], begin=[1], end=[101]))
        kt = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(k_part, [0, 1, 3, 2])), [8, 128, 100]))
        s = bb.emit(relax.op.matmul(bb.emit(relax.op.reshape(q, [8, 1, 128])), kt, out_dtype="float32"))
        p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s)), "float16"))
        v_part = bb.emit(relax.op.reshape(bb.emit(relax.op.strided_slice(v, axes=[2], begin=[1], end=[101])), [8, 100, 128]))
        o = bb.emit(relax.op.matmul(p, v_part, out_dtype="float32"))
        return relax.Tuple([bb.emit(relax.op.astype(o, "float16")), k, v])

    after = fused(main_module(body, [q, k, v, new_k, new_v]))
    assert calls_of(after) == ["fused_decode_attention", "fused_decode_attention_combine"]
    assert after["main"].script().count("R.concat") == 2


def test_the_key_view_repeats_each_cache_head_for_its_query_heads():
    kernel = fused(decode_chain(2, 100))["fused_decode_attention"].script()
    assert "// 2" in kernel  # query head -> its cache head: heads / kv_heads = 2


def test_a_kernel_that_does_not_build_leaves_the_chain_with_one_warning(monkeypatch):
    """The kernels go through the TIR half of a build before they replace the chain: one that fails
    there costs the chain its fusion, not the model its build."""
    def failing(func, name, target):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(attention_pass, "check_builds", failing)
    with pytest.warns(tvm_ext.FallbackWarning, match="fused_decode_attention: tvm_ext attention kernel failed"):
        after = fused(decode_chain(2, 100))
    assert calls_of(after) == [] and "R.nn.softmax" in after["main"].script()


def test_targets_off_cuda_keep_the_spelled_out_chain():
    assert calls_of(fused(decode_chain(2, 100), tvm.target.Target("llvm"))) == []


def test_sizes_over_two_symbolic_dims_are_fitted_as_polynomials_in_both():
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    points = [(x, y) for x in SAMPLE_LENGTHS for y in SAMPLE_LENGTHS]
    fitted = _fitted([(x * 4 * (y + 1) * 128, x, y + 1, 7) for x, y in points], [b, n])
    analyzer = tvm.sym.Analyzer()
    assert analyzer.can_prove_equal(fitted[0], b * (n + 1) * 512) and fitted[1] is b and fitted[3] == 7
    assert analyzer.can_prove_equal(fitted[2], n + 1)
    assert _fitted([x * y * y * y for x, y in points], [b, n]) is None  # degree 3: no fit


def test_splits_fill_the_gpu_and_keep_chunks_long():
    assert decode_attention.splits(32, 4096, 132) == 17  # 528 blocks aimed for
    assert decode_attention.splits(1024, 4096, 132) == 1
    assert decode_attention.splits(1, 100, 132) == 2  # chunks of 64 keys at least
    assert decode_attention.splits(1, 10**6, 132) == decode_attention.MAX_SPLITS


def test_sizes_the_kernel_does_not_take_are_a_clear_error():
    with pytest.raises(ValueError, match="dim=96"):
        decode_attention.partial_kernel(4, 128, 96, 0.1, 132)


def _run_kernels(torch, batch, seq_kv, dim, q, k, v):
    """The partial and combine kernels built alone for these static sizes, on q [batch, 1, dim] and
    k, v [batch, seq_kv, dim] (fp16 or bf16)."""
    scale = 1 / math.sqrt(dim)
    target = tvm_ext.parse_target("cuda")
    sm_count = tvm_ext.schedules.device.device_of(target).sm_count
    dtype = str(q.dtype).removeprefix("torch.")
    mod = tvm.IRModule({"partial": decode_attention.partial_kernel(batch, seq_kv, dim, scale, sm_count, dtype=dtype)
                        .with_attr("global_symbol", "partial"),
                        "combine": decode_attention.combine_kernel(batch, seq_kv, dim, sm_count, dtype=dtype)
                        .with_attr("global_symbol", "combine")})
    lib = tvm.compile(mod, target=target)
    values, max_sum = (torch.zeros(shape, device="cuda") for shape in decode_attention.workspace_shapes(batch, dim))
    out = torch.full_like(q, float("nan"))
    lib["partial"](*[tvm.runtime.from_dlpack(x) for x in (q, k, v, values, max_sum)])
    lib["combine"](*[tvm.runtime.from_dlpack(x) for x in (values, max_sum, out)])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_kv, dim", [(32, 1, 128), (4, 63, 64), (32, 1000, 128), (2, 4097, 128),
                                                (8, 300, 256), (1, 70000, 64)])
@pytest.mark.parametrize("dtype, tolerance", [("float16", 2e-3), ("bfloat16", 1.6e-2)])  # about an output ulp
def test_kernels_match_float64_attention(batch, seq_kv, dim, dtype, tolerance):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype)
    q = torch.randn(batch, 1, dim, device="cuda").to(dtype)
    k = (torch.randn(batch, seq_kv, dim, device="cuda") * 3).to(dtype)  # scores spread over a wide range
    v = torch.randn(batch, seq_kv, dim, device="cuda").to(dtype)
    out = _run_kernels(torch, batch, seq_kv, dim, q, k, v)
    scores = (q.double() @ k.double().transpose(1, 2)) / math.sqrt(dim)
    want = torch.softmax(scores, -1) @ v.double()
    assert float((out.double() - want).abs().max()) < tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, shapes, dtype, atol", [
    (4, ((1, 1), (1, 127), (3, 500), (8, 2047), (2, 5000)), "float16", 3e-2),
    (4, ((1, 1), (3, 500), (2, 5000)), "bfloat16", 1.25e-1),  # a few bf16 ulps of outputs up to ~8
    # GQA at one cache length: torch 2.11's export cannot prove repeat_kv's guard at a symbolic one
    (2, ((1, 37), (2, 37), (7, 37)), "float16", 3e-2)], ids=["mha", "mha-bf16", "gqa"])
def test_decode_layer_built_once_matches_pytorch_at_every_batch_and_cache_length(kv_heads, shapes, dtype, atol):
    torch = pytest.importorskip("torch")
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    from examples.torch_models import DECODE_DYNAMIC, LlamaDecodeLayer, decode_inputs  # noqa: PLC0415

    torch.manual_seed(0)
    dtype = getattr(torch, dtype)
    module = LlamaDecodeLayer(512, 4, 1024, kv_heads=kv_heads).eval().to(dtype)
    pasts = {past for _, past in shapes}
    dynamic = DECODE_DYNAMIC if len(pasts) > 1 else {i: {0: DECODE_DYNAMIC[i][0]} for i in range(3)}
    mod = tvm_ext.from_torch(module, *decode_inputs(module, 2, 37, dtype), dynamic=dynamic)  # examples of 1 would be taken for constants
    executable = tvm_ext.build(mod, "cuda")
    assert any("decode_attention" in k for k in tvm_ext.cuda_kernels(executable))
    main = VirtualMachine(executable, tvm.cuda(0))["main"]
    for batch, past in shapes:
        inputs = decode_inputs(module, batch, past, dtype)
        got = main(*(tvm.runtime.from_dlpack(t.cuda()) for t in inputs))
        with torch.no_grad():  # PyTorch in the same dtype: the new key's rotary angles are rounded alike
            want = module.cuda()(*(t.cuda() for t in inputs))
        for g, w, what in zip(got, want, ("output", "keys", "values")):
            np.testing.assert_allclose(torch.from_dlpack(g).float().cpu().numpy(), w.float().cpu().numpy(), atol=atol,
                                       err_msg=f"{what} at batch {batch}, past {past}")


@pytest.mark.gpu
@pytest.mark.parametrize("keys_axis", [2, 1])
def test_a_grown_cache_and_attention_over_it_match_numpy_from_one_build(keys_axis, rng):
    """Built once for any batch and length, GQA, both cache layouts: the output against float64 and
    the grown caches against the concatenation, at lengths whose chunks end inside the new row's."""
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    dims = (tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("past", "int64"))
    main = VirtualMachine(tvm_ext.build(decode_chain(*dims, grown=True, keys_axis=keys_axis), "cuda"), tvm.cuda())["main"]
    for batch, past in ((1, 1), (2, 63), (3, 500), (1, 4095)):
        shape = (lambda n: (batch, 2, n, 128)) if keys_axis == 2 else (lambda n: (batch, n, 2, 128))
        q = rng.standard_normal((batch, 4, 1, 128)).astype("float16")
        k, v, new_k, new_v = (rng.standard_normal(shape(n)).astype("float16") for n in (past, past, 1, 1))
        out, k_all, v_all = main(*(tvm.runtime.tensor(x, tvm.cuda()) for x in (q, k, v, new_k, new_v)))
        np.testing.assert_array_equal(k_all.numpy(), np.concatenate([k, new_k], axis=keys_axis))
        np.testing.assert_array_equal(v_all.numpy(), np.concatenate([v, new_v], axis=keys_axis))
        keys, values = (np.concatenate([x, x_new], axis=keys_axis).astype("float64") for x, x_new in ((k, new_k), (v, new_v)))
        if keys_axis == 1:
            keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
        keys, values = np.repeat(keys, 2, axis=1), np.repeat(values, 2, axis=1)  # each cache head serves 2 query heads
        scores = q.astype("float64") @ keys.transpose(0, 1, 3, 2) / math.sqrt(128)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        want = (probs / probs.sum(-1, keepdims=True)) @ values
        np.testing.assert_allclose(out.numpy().reshape(want.shape), want, atol=2e-3, rtol=2e-3, err_msg=f"batch {batch}, past {past}")


def test_the_cuda_reads_16_byte_rows_and_sums_a_row_across_its_lanes():
    from tvm_ext.introspect import cuda_source  # noqa: PLC0415

    source = cuda_source(tvm_ext.build(decode_chain(2, 300), SM_90A))
    partial = source.split("fused_decode_attention_kernel(")[-1].split("extern \"C\"")[0]
    assert partial.count("*(uint4*)(k_r") == decode_attention.UNROLL and "__shfl_xor_sync" in partial  # 16 lanes: 4 steps
    assert partial.count("__shfl_xor_sync") == decode_attention.UNROLL * 4
    assert "fused_decode_attention_combine_kernel(" in source and "exp2f" in source


@pytest.mark.parametrize("grown", [False, True])
def test_the_partial_kernel_is_a_task_checked_by_its_chunks_states(grown, tmp_path):
    """A decoding step's partial kernel is a tuning task: its knobs (threads, keys in flight) leave the
    chunks, and so the combine kernel and the workspace, as they are. Its reference gives each
    (row, chunk)'s softmax state, which combined is numpy's attention; the chunks past a row's are NaN
    (the kernel leaves them as the runner's poison left them); a grown cache is the concatenation."""
    from search import check  # noqa: PLC0415
    from tvm_ext.schedules.dispatch import contraction_template  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    target = tvm_ext.parse_target(SM_90A)
    (task,) = extract_tasks(decode_chain(2, 300, grown=grown), target)
    assert contraction_template(task.func, target) is decode_attention
    points = knob_space(task.func, target)
    assert points[0] == decode_attention.DEFAULT_KNOBS and len(points) == 9
    func = check.measured(task.func, {})
    arrays, _ = check.reference_arrays(func, {}, str(tmp_path / "reference.npz"))
    q, k, v = (a.astype("float64") for a in arrays[:1] + (
        [np.concatenate(arrays[1:3], axis=2), np.concatenate(arrays[3:5], axis=2)] if grown else arrays[1:3]))
    values, state = arrays[5:7] if grown else arrays[3:5]
    if grown:
        np.testing.assert_array_equal(arrays[7], k.astype("float16"))
        np.testing.assert_array_equal(arrays[8], v.astype("float16"))
    used = decode_attention.splits(8, k.shape[2], device_of(target).sm_count)
    assert np.isnan(values[:, used:]).all() and np.isnan(state[:, used:]).all() and not np.isnan(values[:, :used]).any()
    top = state[:, :used, 0].max(-1, keepdims=True)
    weight = np.exp2(state[:, :used, 0] - top)
    got = (values[:, :used] * weight[..., None]).sum(1) / (state[:, :used, 1] * weight).sum(1, keepdims=True)
    keys, vals = (np.repeat(x, 2, axis=1).reshape(8, -1, 128) for x in (k, v))  # each cache head serves two query heads
    scores = np.einsum("rd,rkd->rk", q.reshape(8, 128), keys) / math.sqrt(128)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("rk,rkd->rd", p / p.sum(-1, keepdims=True), vals)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_logged_point_remakes_the_partial_kernel_and_keeps_the_combine(tmp_path):
    from tvm_ext.introspect import cuda_source  # noqa: PLC0415
    from tvm_ext.records import append_record  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    target = tvm_ext.parse_target(SM_90A)
    (task,) = extract_tasks(decode_chain(2, 300), target)
    knobs = {"strategy": decode_attention.NAME, "threads": 256, "unroll": 2}
    log = tmp_path / "log.json"
    append_record(log, task.func, target, task.name, knobs, 10.0)
    tuned, plain = (cuda_source(tvm_ext.build(decode_chain(2, 300), SM_90A, **kwargs)) for kwargs in ({"database": log}, {}))
    partial = lambda source: source.split("fused_decode_attention_kernel(")[-1].split("extern \"C\"")[0]  # noqa: E731
    assert "__launch_bounds__(256) fused_decode_attention_kernel" in tuned and partial(tuned).count("*(uint4*)(k_r") == 2
    assert "__launch_bounds__(128) fused_decode_attention_kernel" in plain
    combine = lambda source: source.split("fused_decode_attention_combine_kernel(")[-1]  # noqa: E731
    assert combine(tuned) == combine(plain)


def test_a_decode_layer_built_for_any_size_is_measured_at_the_given_dims(tmp_path):
    """The task of a decode layer imported for any batch and cache length: its candidates are the
    kernel of the sizes --dims gives (batch 4, 100 cached positions), and so is its reference."""
    torch = pytest.importorskip("torch")
    from examples.torch_models import DECODE_DYNAMIC, LlamaDecodeLayer, decode_inputs  # noqa: PLC0415
    from search import check  # noqa: PLC0415
    from tvm_ext.search.strategy import TaskSearch  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    torch.manual_seed(0)
    module = LlamaDecodeLayer(256, 2, 512, kv_heads=1).eval().half()  # two query heads of 128 over one cache head
    mod = tvm_ext.from_torch(module, *decode_inputs(module, 2, 128, torch.float16), dynamic=DECODE_DYNAMIC)
    target = tvm_ext.parse_target(SM_90A)
    task = next(t for t in extract_tasks(mod, target) if t.name.startswith("fused_decode_attention"))
    dims = {"batch": 4, "past": 100}
    assert TaskSearch(task, target, str(tmp_path / "log.json"), 8, dims).at == dims
    func = check.measured(task.func, dims)
    assert [[int(d) for d in p.ty.shape] for p in func.params[:3]] == [[4, 2, 1, 128], [4, 1, 100, 128], [4, 1, 1, 128]]
    arrays, _ = check.reference_arrays(func, dims, str(tmp_path / "reference.npz"))
    assert [a.shape for a in arrays[-4:]] == [(8, 32, 128), (8, 32, 2), (4, 1, 101, 128), (4, 1, 101, 128)]
