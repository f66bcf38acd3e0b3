"""Relax rewrites before legalization: the transposed key read as stored, activations and residual
adds before reshapes."""

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_ext
from bench.spelled import main_module
from conftest import CUDA_TARGET
from tvm_ext.schedules import matmul
from tvm_ext.introspect import cuda_source
from tvm_ext.relax.layout_rewrites import activation_before_reshape, read_transposed_operand


def attention_scores(shape, dtype, axes=(0, 1, 3, 2), cast=False):
    """matmul(q, permute_dims(k)) as TVM's PyTorch frontend writes it: the transposed key broadcast
    to itself and reshaped to 3-D batches; with `cast`, the float32 product rounded back to `dtype`."""
    b, h, n, d = shape
    q, k = (relax.Var(name, relax.TensorType(list(shape), dtype)) for name in "qk")

    def body(bb, q, k):
        kt = bb.emit(relax.op.permute_dims(k, list(axes)))
        kt = bb.emit(relax.op.broadcast_to(kt, kt.ty.shape))
        kt = bb.emit(relax.op.reshape(kt, [b * h, *[int(x) for x in kt.ty.shape.values[-2:]]]))
        product = relax.op.matmul(bb.emit(relax.op.reshape(q, [b * h, n, d])), kt, out_dtype="float32")
        return relax.op.astype(bb.emit(product), dtype) if cast else product
    return main_module(body, [q, k])


def _ops(mod) -> list:
    text = mod["main"].script()
    return [op for op in ("permute_dims", "matmul_nt", "R.matmul") if op in text]


def test_the_transposed_key_is_read_as_stored():
    mod = read_transposed_operand(attention_scores((2, 4, 64, 32), "float16"))
    assert _ops(mod) == ["matmul_nt"]  # no transpose left, no plain matmul


def test_other_permutations_are_left_alone():
    mod = read_transposed_operand(attention_scores((2, 4, 32, 32), "float16", axes=(1, 0, 2, 3)))
    assert _ops(mod) == ["permute_dims", "R.matmul"]


def test_the_result_is_the_product_with_the_transpose(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    q, k = rng.standard_normal((2, 2, 3, 16, 8)).astype("float32")
    out = VirtualMachine(tvm_ext.build(attention_scores(q.shape, "float32"), "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(q), tvm.runtime.tensor(k)).numpy()
    np.testing.assert_allclose(out, (q @ k.transpose(0, 1, 3, 2)).reshape(6, 16, 16), rtol=1e-5, atol=1e-5)


def test_the_fp16_product_goes_to_the_tensor_cores_with_a_col_major_key():
    target = tvm_ext.parse_target(CUDA_TARGET)
    fused = tvm_ext.pipeline.fused_module(attention_scores((1, 8, 128, 64), "float16"), target)
    func = next(f for gv, f in fused.functions_items() if "matmul_nt" in gv.name_hint)
    assert matmul.tensor_core_matmul(func) is not None
    source = cuda_source(tvm_ext.build(attention_scores((1, 8, 128, 64), "float16"), CUDA_TARGET))
    assert "wmma::mma_sync" in source and "wmma::col_major" in source


@pytest.mark.gpu
def test_the_fp16_product_is_right_on_the_gpu(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    q, k = rng.integers(-3, 4, (2, 1, 8, 128, 64)).astype("float16")
    dev = tvm.cuda()
    out = VirtualMachine(tvm_ext.build(attention_scores(q.shape, "float16"), "cuda"), dev)["main"](
        tvm.runtime.tensor(q, dev), tvm.runtime.tensor(k, dev)).numpy()
    want = q.astype("float32") @ k.astype("float32").transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(out, want.reshape(8, 128, 128))


def test_every_tiling_of_llamas_scores_with_their_cast_builds():
    """The cast back to fp16 is computed from a shared stage. Its size check assumed B's tile is
    [bk, bn]; the key's is [bn, bk], so a stage TVM then put in an fp16 tile passed the check and
    failed the build ("tvm_access_ptr element type must match") for LLaMA on the H200."""
    target = tvm_ext.parse_target(CUDA_TARGET)
    mod = attention_scores((1, 32, 512, 128), "float16", cast=True)
    func = next(f for gv, f in tvm_ext.pipeline.fused_module(mod, target).functions_items() if "matmul_nt" in gv.name_hint)
    space = matmul.knob_space(func)
    assert len(space) >= 5
    from tvm_ext.tir.tensorize import auto_tensorize  # noqa: PLC0415

    for knobs in space:
        scheduled = auto_tensorize(matmul.apply(func, knobs).mod["main"]).with_attr("global_symbol", "main")
        with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
            tvm.compile(tvm.IRModule({"main": scheduled}), target=target)


def linear_gelu_linear(rows, hidden, inner, dtype):
    """What the frontend makes of fc2(gelu(fc1(x))) on [2, rows / 2, hidden]: 2-D products in
    float32 rounded to `dtype`, the activation between reshapes to 3-D and back."""
    x = relax.Var("x", relax.TensorType([rows, hidden], dtype))
    w1, w2 = relax.Var("w1", relax.TensorType([hidden, inner], dtype)), relax.Var("w2", relax.TensorType([inner, hidden], dtype))
    op = relax.op

    def body(bb, x, w1, w2):
        h = bb.emit(op.reshape(bb.emit(op.astype(op.matmul(x, w1, out_dtype="float32"), dtype)), [2, rows // 2, inner]))
        g = bb.emit(op.reshape(bb.emit(op.nn.gelu(h)), [rows, inner]))
        return op.matmul(g, w2)
    return main_module(body, [x, w1, w2])


def test_an_activation_between_reshapes_joins_the_matmul_before_it():
    mod = activation_before_reshape(linear_gelu_linear(256, 128, 512, "float16"))
    assert "reshape" not in mod["main"].script()  # gelu on the 2-D product; the round trip folded away
    fused = tvm_ext.pipeline.fused_module(linear_gelu_linear(256, 128, 512, "float16"), tvm_ext.parse_target(CUDA_TARGET))
    names = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("matmul" in n and "gelu" in n for n in names) and not any("reshape" in n for n in names)
    func = next(f for gv, f in fused.functions_items() if "gelu" in gv.name_hint)
    assert matmul.tensor_core_matmul(func) is not None  # GELU reads its input twice: folded into the stage
    assert "wmma::mma_sync" in cuda_source(tvm_ext.build(linear_gelu_linear(256, 128, 512, "float16"), CUDA_TARGET))


def test_the_moved_activation_computes_the_same(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415
    from math import erf  # noqa: PLC0415

    x, w1, w2 = (rng.standard_normal(s).astype("float32") * 0.3 for s in ((8, 16), (16, 32), (32, 16)))
    out = VirtualMachine(tvm_ext.build(linear_gelu_linear(8, 16, 32, "float32"), "llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in (x, w1, w2)]).numpy()
    h = x @ w1
    gelu = h * 0.5 * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    np.testing.assert_allclose(out, gelu @ w2, rtol=1e-5, atol=1e-5)


def linear_residual(rows, hidden, dtype, residual_first=True):
    """What the frontend makes of x + fc(x) on [2, rows / 2, hidden]: the 2-D product rounded to
    `dtype`, reshaped to 3-D, then the residual added (PyTorch's `x + f(x)` puts it first)."""
    x = relax.Var("x", relax.TensorType([2, rows // 2, hidden], dtype))
    w = relax.Var("w", relax.TensorType([hidden, hidden], dtype))
    op = relax.op

    def body(bb, x, w):
        rows_of_x = bb.emit(op.reshape(x, [rows, hidden]))
        y = bb.emit(op.reshape(bb.emit(op.astype(op.matmul(rows_of_x, w, out_dtype="float32"), dtype)), [2, rows // 2, hidden]))
        return op.add(x, y) if residual_first else op.add(y, x)
    return main_module(body, [x, w])


@pytest.mark.parametrize("residual_first", [True, False])
def test_a_residual_added_after_a_reshaped_matmul_joins_its_epilogue(residual_first):
    fused = tvm_ext.pipeline.fused_module(linear_residual(256, 128, "float16", residual_first), tvm_ext.parse_target(CUDA_TARGET))
    names = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("matmul" in n and "add" in n for n in names)  # one kernel: the add in the matmul's epilogue
    assert not any("add" in n and "matmul" not in n for n in names)  # before the rewrite: fused_reshape_add


def test_the_moved_residual_computes_the_same(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    x, w = rng.standard_normal((2, 4, 16)).astype("float32"), rng.standard_normal((16, 16)).astype("float32")
    for residual_first in (True, False):
        out = VirtualMachine(tvm_ext.build(linear_residual(8, 16, "float32", residual_first), "llvm"), tvm.cpu())["main"](
            tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(out, x + (x.reshape(8, 16) @ w).reshape(2, 4, 16), rtol=1e-5, atol=1e-5)


SM_90A = {"kind": "cuda", "arch": "sm_90a"}


def linear(rows, n, k, dtype="float16", seed=0):
    """x @ W.T with a constant [n, k] weight as the frontend writes torch.nn.Linear: a transpose,
    then the float32 product rounded to `dtype`."""
    weight = (np.random.default_rng(seed).standard_normal((n, k)) / 8).astype(dtype)
    x = relax.Var("x", relax.TensorType([rows, k], dtype))

    def body(bb, x):
        transposed = bb.emit(relax.op.permute_dims(relax.const(weight)))
        return relax.op.astype(bb.emit(relax.op.matmul(x, transposed, out_dtype="float32")), dtype)
    return main_module(body, [x]), weight


def _fused_matmul(mod, target):
    fused = tvm_ext.pipeline.fused_module(mod, tvm_ext.parse_target(target))
    return next(f for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint)


def test_on_sm_90a_a_linear_reads_its_weight_as_stored():
    from tvm_ext.schedules import wgmma_matmul  # noqa: PLC0415

    mod, _ = linear(512, 448, 256)
    func = _fused_matmul(mod, SM_90A)
    assert [int(d) for d in func.params[1].shape] == [448, 256]  # [n, k]: no transpose folded into a [k, n] copy
    assert 224 in {p["block_n"] for p in wgmma_matmul.knob_space(func)}  # any 32 columns wide, not whole 64-column atoms
    sm_90 = _fused_matmul(mod, CUDA_TARGET)
    assert [int(d) for d in sm_90.params[1].shape] == [256, 448]  # sm_90 (the mma.sync template): folded as before


def test_few_row_linears_keep_their_transpose_for_split_k():
    mod, _ = linear(64, 4096, 4096)
    fused = tvm_ext.pipeline.fused_module(mod, tvm_ext.parse_target(SM_90A))
    assert not any("matmul_nt" in gv.name_hint for gv, _ in fused.functions_items())


def test_the_weight_read_as_stored_gives_the_product(rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    mod, weight = linear(128, 64, 64)
    with tvm_ext.parse_target(SM_90A):
        rewritten = read_transposed_operand(mod)
    assert _ops(rewritten) == ["matmul_nt"]
    x = rng.standard_normal((128, 64)).astype("float16")
    got = VirtualMachine(tvm_ext.build(rewritten, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    want = (x.astype("float32") @ weight.astype("float32").T).astype("float16")
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def test_on_sm_90a_the_residual_stays_in_the_epilogue_of_a_linear_read_as_stored():
    """The residual rewrite knows a matmul as relax.matmul, so it must run before the weight is read
    as stored (matmul_nt): the other order left LLaMA's residual adds as kernels of their own."""
    weight = relax.const((np.random.default_rng(0).standard_normal((128, 128)) / 8).astype("float16"))
    x = relax.Var("x", relax.TensorType([2, 128, 128], "float16"))
    op = relax.op

    def body(bb, x):
        rows = bb.emit(op.reshape(x, [256, 128]))
        product = bb.emit(op.matmul(rows, bb.emit(op.permute_dims(weight)), out_dtype="float32"))
        return op.add(x, bb.emit(op.reshape(bb.emit(op.astype(product, "float16")), [2, 128, 128])))
    fused = tvm_ext.pipeline.fused_module(main_module(body, [x]), tvm_ext.parse_target(SM_90A))
    names = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("matmul_nt" in n and "add" in n for n in names), names
    assert not any("add" in n and "matmul" not in n for n in names), names
