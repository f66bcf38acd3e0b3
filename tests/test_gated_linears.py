"""A gated MLP's activation in its joined matmul's epilogue (sm_90a): the interleaved weight, the
one kernel it becomes, its CUDA, and its numbers (the CPU running the fused functions unscheduled;
the GPU every tile of the wgmma template). At one row and at a symbolic row count every row
class's kernel writes the activation: the GEMV, the few-row kernels and the wgmma tiles."""

import re
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.spelled import main_module
from helpers import kernel_bodies
from tvm_ext.schedules import dispatch, few_row_matmul, gemv, wgmma_matmul
from tvm_ext.schedules.contracts import gate_column
from tvm_ext.relax import parallel_matmuls
from tvm_ext.relax.gated_linears import interleaved
from tvm_ext.introspect import cuda_kernels, cuda_source
from tvm_ext.pipeline import fused_module

SM_90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})  # 132 SMs
op = relax.op


def mlp(rows, hidden, inner, gated=True, seed=0):
    """LLaMA's MLP as TVM's PyTorch frontend writes it: down(silu(gate(x)) * up(x)), each Linear a
    reshape to rows, a float32 product by the transposed weight, a cast to fp16 and a reshape back;
    without `gated`, gate(x) and up(x) returned apart. Returns the module and its weights."""
    rng = np.random.default_rng(seed)
    weights = [(rng.standard_normal(s) / 8).astype("float16") for s in ((inner, hidden), (inner, hidden), (hidden, inner))]

    def linear(bb, x, w):
        rows_of_x = bb.emit(op.reshape(x, [rows, w.shape[1]]))
        product = bb.emit(op.matmul(rows_of_x, bb.emit(op.permute_dims(relax.const(w), [1, 0])), out_dtype="float32"))
        return bb.emit(op.reshape(bb.emit(op.astype(product, "float16")), [1, rows, w.shape[0]]))

    def body(bb, x):
        gate, up = linear(bb, x, weights[0]), linear(bb, x, weights[1])
        if not gated:
            return relax.Tuple([gate, up])
        activated = bb.emit(op.astype(op.nn.silu(op.astype(gate, "float32")), "float16"))
        return linear(bb, bb.emit(op.multiply(activated, up)), weights[2])
    return main_module(body, [relax.Var("x", relax.TensorType([1, rows, hidden], "float16"))]), weights


def any_rows_mlp(hidden, inner):
    """mlp over a symbolic row count m."""
    return mlp(tvm.tirx.Var("m", "int64"), hidden, inner)


def gated_product(x, weights):
    """silu(x @ gate.T) * (x @ up.T) for x [rows, hidden], rounded to fp16 as PyTorch does."""
    gate, up = reference(x[None], weights, gated=False)
    g = gate[0].astype("float32")
    return ((g / (1 + np.exp(-g))).astype("float16") * up[0]).astype("float32")


def reference(x, weights, gated=True):
    """The MLP in NumPy, rounding to fp16 where PyTorch does."""
    gate, up = ((x[0].astype("float32") @ w.astype("float32").T).astype("float16") for w in weights[:2])
    if not gated:
        return [gate[None], up[None]]
    g = gate.astype("float32")
    h = (g / (1 + np.exp(-g))).astype("float16") * up
    return (h.astype("float32") @ weights[2].astype("float32").T).astype("float16")[None]


def prim_funcs(mod) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.fixture
def always_joined(monkeypatch):
    """Small layers joined as if they made the waves of tiles joining asks for (fast CPU tests)."""
    monkeypatch.setattr(parallel_matmuls, "worth_joining", lambda *_: True)


def test_the_interleaved_weight_alternates_runs_of_eight_rows_of_each_layer():
    gate, up = np.arange(32 * 2).reshape(32, 2), -np.arange(32 * 2).reshape(32, 2)
    joint = interleaved([gate, up])
    assert np.array_equal(joint[:8], gate[:8]) and np.array_equal(joint[8:16], up[:8])
    assert np.array_equal(joint[16:24], gate[8:16]) and np.array_equal(joint[56:], up[24:])
    j = np.arange(32)
    assert np.array_equal(joint[gate_column(j, 0)], gate) and np.array_equal(joint[gate_column(j, 1)], up)


def test_on_sm_90a_the_activation_is_in_the_epilogue_of_the_joined_matmul():
    mod, _ = mlp(512, 128, 8192)  # 4 x 64 tiles of 128 x 256 joined: the waves joining asks for
    funcs = prim_funcs(fused_module(mod, SM_90A))
    gated = [f for name, f in funcs.items() if "gated" in name]
    assert len(gated) == 1, list(funcs)
    assert not any("strided_slice" in name and "matmul" not in name for name in funcs), list(funcs)  # no kernel reads halves
    func = gated[0]
    assert [int(d) for d in func.params[1].shape] == [16384, 128]  # the joint weight, read as stored
    assert [int(d) for d in func.params[-1].shape] == [512, 8192]  # half of C's columns
    assert dispatch.contraction_template(func, SM_90A) is wgmma_matmul
    assert wgmma_matmul._fit(func)[1].gated
    assert dispatch.contraction_template(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None


def test_without_the_interleave_nothing_is_merged():
    mod, _ = mlp(512, 128, 8192)
    sm_90 = prim_funcs(fused_module(mod, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})))
    assert not any("gated" in name for name in sm_90), list(sm_90)


def test_the_cuda_computes_the_activation_on_the_accumulators_and_stores_half_the_columns():
    mod, _ = mlp(512, 128, 8192)
    executable = tvm_ext.build(mod, SM_90A)
    kernels = cuda_kernels(executable)
    products = [k for k in kernels if "matmul" in k]
    assert len(products) == 2 and all("matmul" in k or k.startswith("reshape") for k in kernels), kernels  # gate+up with the activation, down
    src = cuda_source(executable)
    gated = src[src.rindex(next(k for k in kernels if "gated" in k) + "("):]  # its definition, after the declaration
    gated = gated[:gated.index("\n}\n")]
    assert "mma_async_sync_aligned_m64n" in gated
    staged = [line for line in gated.splitlines() if "smem_ptr[" in line and "acc_ptr[" in line]
    regs = int(re.search(r"m64n(\d+)k16", gated).group(1)) // 2  # accumulators per thread of a 64 x n wgmma
    assert len(staged) == regs // 2  # one result per gate register and its up register
    assert "expf(" in staged[0] and "acc_ptr[0]" in staged[0] and "acc_ptr[4]" in staged[0]


def test_at_any_row_count_every_row_class_writes_the_activation():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of the gated kernels is left to TVM
        bodies = kernel_bodies(cuda_source(tvm_ext.build(any_rows_mlp(128, 256)[0], SM_90A)))
    assert not any("strided_slice" in name for name in bodies), sorted(bodies)  # no kernel reads a half
    gated = {name: body for name, body in bodies.items() if "gated" in name and "_i32" not in name}
    assert len(gated) >= 4, sorted(bodies)
    assert all("__expf(" in body or "expf(" in body for body in gated.values())
    one_row, *rest = sorted(gated)
    assert "__shfl" in gated[one_row] and "mma" not in gated[one_row]  # the GEMV
    assert sum("mma.sync.aligned.m16n8k16" in gated[name] for name in rest) == 2  # up to 16 and to 32 rows
    assert all("wgmma" in gated[name] for name in rest if "m16n8k16" not in gated[name])


def test_one_row_is_one_gated_gemv_over_the_joint_weight():
    mod, _ = mlp(1, 128, 256)
    func = next(f for name, f in prim_funcs(fused_module(mod, SM_90A)).items() if "gated" in name)
    assert dispatch.contraction_template(func, SM_90A) is gemv
    assert [int(d) for d in func.params[1].shape] == [512, 128] and [int(d) for d in func.params[-1].shape] == [1, 256]
    assert {p["rows"] for p in gemv.knob_space(func)} == {2, 4}  # a column's gate and up rows in one group


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "halves-apart"])
def test_the_fused_functions_compute_the_mlp(always_joined, gated, rng):
    mod, weights = mlp(128, 64, 64, gated=gated)
    fused = fused_module(mod, SM_90A)
    assert any("gated" in name for name in prim_funcs(fused)) == gated
    x = rng.standard_normal((1, 128, 64)).astype("float16")
    outs = VirtualMachine(tvm.compile(fused, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x))
    outs = [outs] if gated else list(outs)
    want = reference(x, weights, gated)
    want = [want] if gated else want
    for got, expected in zip(outs, want):
        np.testing.assert_allclose(got.numpy().astype("float32"), expected.astype("float32"), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_every_tile_of_the_gated_matmul_on_gpu(rng):
    mod, weights = mlp(512, 128, 8192)
    func = next(f for name, f in prim_funcs(fused_module(mod, SM_90A)).items() if "gated" in name)
    x = rng.standard_normal((512, 128)).astype("float16")
    joint = interleaved(weights[:2])
    gate, up = reference(x[None], weights, gated=False)
    g = gate[0].astype("float32")
    want = ((g / (1 + np.exp(-g))).astype("float16") * up[0]).astype("float32")
    dev = tvm.cuda()
    points = wgmma_matmul.knob_space(func)
    assert {p["block_n"] for p in points} >= {256, 224, 128} and any(p.get("tma") for p in points)
    for knobs in points:
        lib = tvm.compile(tvm.IRModule({"main": wgmma_matmul.apply(func, knobs).mod["main"].with_attr("global_symbol", "main")}),
                          target=SM_90A)
        out = tvm.runtime.tensor(np.full((512, 8192), np.nan, "float16"), dev)
        lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(joint, dev), out)
        np.testing.assert_allclose(out.numpy().astype("float32"), want, rtol=1e-2, atol=1e-2, err_msg=str(knobs))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, template", [(1, gemv), (13, few_row_matmul), (32, few_row_matmul)])
def test_every_gemv_and_few_row_point_of_the_gated_matmul_on_gpu(rows, template, rng):
    """The GEMV's on the one-row function; the few-row kernels' on the function of any row count
    (a static one of a few rows reads the weight transposed), run at `rows`."""
    mod, weights = mlp(1, 256, 1536) if template is gemv else any_rows_mlp(256, 1536)
    func = next(f for name, f in prim_funcs(fused_module(mod, SM_90A)).items() if "gated" in name)
    x = rng.standard_normal((rows, 256)).astype("float16")
    want, dev = gated_product(x, weights), tvm.cuda()
    points = [p for p in template.knob_space(func) if p["rows"] >= rows]  # a few-row kernel serves up to its rows
    assert points
    for knobs in points:
        lib = tvm.compile(tvm.IRModule({"main": template.apply(func, knobs).mod["main"].with_attr("global_symbol", "main")}),
                          target=SM_90A)
        out = tvm.runtime.tensor(np.full((rows, 1536), np.nan, "float16"), dev)
        lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(interleaved(weights[:2]), dev), out)
        np.testing.assert_allclose(out.numpy().astype("float32"), want, rtol=1e-2, atol=1e-2, err_msg=str(knobs))


@pytest.mark.gpu
def test_every_row_class_of_the_gated_mlp_on_gpu(rng):
    mod, weights = any_rows_mlp(256, 1536)
    main = VirtualMachine(tvm_ext.build(mod, SM_90A), tvm.cuda())["main"]
    for rows in (1, 3, 16, 17, 32, 33, 64, 100, 300):
        x = rng.standard_normal((1, rows, 256)).astype("float16")
        got = main(tvm.runtime.tensor(x, tvm.cuda())).numpy()
        np.testing.assert_allclose(got.astype("float32"), reference(x, weights).astype("float32"), rtol=2e-2, atol=2e-2,
                                   err_msg=f"{rows} rows")


@pytest.mark.gpu
def test_the_gated_mlp_through_the_pipeline_on_gpu(rng):
    mod, weights = mlp(512, 256, 8192)
    executable = tvm_ext.build(mod, SM_90A)
    assert sum("matmul" in k for k in cuda_kernels(executable)) == 2
    x = rng.standard_normal((1, 512, 256)).astype("float16")
    got = VirtualMachine(executable, tvm.cuda())["main"](tvm.runtime.tensor(x, tvm.cuda())).numpy()
    np.testing.assert_allclose(got.astype("float32"), reference(x, weights).astype("float32"), rtol=2e-2, atol=2e-2)


def test_the_tuner_takes_the_gated_matmul_as_a_wgmma_task():
    from tvm_ext.search.features import NAMES, candidate_features  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    mod, _ = mlp(512, 128, 8192)
    task = next(t for t in extract_tasks(mod, SM_90A) if "gated" in t.name)
    points = knob_space(task.func, SM_90A)
    assert {p["strategy"] for p in points} == {"wgmma_matmul"} and points[0] == dispatch.heuristic_knobs(task.func, SM_90A)
    column = dict(zip(NAMES, candidate_features(task.func, points, SM_90A).T))
    assert (column["is_matmul"] == 1).all() and (column["elementwise_epilogue"] == 1).all()


def test_the_tuners_cpu_reference_of_the_gated_matmul_is_the_activation(always_joined, rng):
    from tvm_ext.search.check import references  # noqa: PLC0415

    mod, weights = mlp(128, 64, 64)
    func = next(f for name, f in prim_funcs(fused_module(mod, SM_90A)).items() if "gated" in name)
    (cpu_func,) = references(func)
    lib = tvm.compile(tvm.IRModule({"main": cpu_func.with_attr("global_symbol", "main")}), target="llvm")
    x = rng.standard_normal((128, 64)).astype("float16")
    args = [tvm.runtime.tensor(a.astype(str(p.ty.dtype))) for a, p in
            zip((x, interleaved(weights[:2]), np.zeros((128, 64), "float16")), cpu_func.params)]
    lib["main"](*args)
    gate, up = reference(x[None], weights, gated=False)
    g = gate[0].astype("float32")
    want = ((g / (1 + np.exp(-g))).astype("float16") * up[0]).astype("float32")
    np.testing.assert_allclose(args[-1].numpy().astype("float32"), want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_the_tuner_measures_gated_candidates_against_the_reference_on_gpu():
    from tvm_ext.search.measure import measure  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415

    mod, _ = mlp(512, 128, 8192)
    func = next(f for name, f in prim_funcs(fused_module(mod, SM_90A)).items() if "gated" in name)
    results = measure(func, SM_90A, knob_space(func, SM_90A)[:3])
    assert all(r.error is None and 0 < r.best_us < 1e4 for r in results), [(r.knobs, r.error) for r in results]
