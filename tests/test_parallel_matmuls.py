"""Linear layers sharing an input joined into one matmul: what is joined, what is left, and the
numbers (run on the CPU) before and after. The layers are wide (32256 columns, 126 tiles of 256 each)
so that two of them joined give the two waves of 128 x 256 tiles on 132 SMs that joining asks for."""

import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
import pytest
import tvm
from tvm import relax
import tvm_ffi
from tvm.ir.expr import GenericConst
from tvm.runtime.vm import VirtualMachine

from bench.spelled import main_module
from tvm_ext.relax.parallel_matmuls import combine_parallel_linears, worth_joining

RNG = np.random.default_rng(0)
WIDE = 126 * 256
WEIGHTS = [(RNG.standard_normal((n, 32)) / 8).astype("float16") for n in (WIDE, WIDE, 64)]
SM_90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})  # an H100/H200: 132 SMs


def joined(mod, target=SM_90A) -> tvm.IRModule:
    with target:
        return combine_parallel_linears(mod)


def linears(weights=WEIGHTS, same_input=True, param_weight=False, matmul_reused=False, dtype="float16",
            rows=16) -> tvm.IRModule:
    """sum of x @ W_i^T over the layers, each Linear spelled as the frontend writes it: its own
    reshape of x to `rows` rows (16, 1 or "m": symbolic), matmul in float32 by the permuted weight,
    astype fp16 (or `dtype`)."""
    weights = [w.astype(dtype) for w in weights]
    rows = tvm.tirx.Var("m", "int64") if rows == "m" else rows
    lead = [2, 8] if rows == 16 else [rows, 1]
    x = relax.Var("x", relax.TensorType([*lead, 32], dtype))
    y = relax.Var("y", relax.TensorType([*lead, 32], dtype))
    w_param = relax.Var("w", relax.TensorType(list(weights[-1].shape), dtype))

    def body(bb, x, y, w_param):
        outs = []
        for i, weight in enumerate(weights):
            rows_of_x = bb.emit(relax.op.reshape(x if same_input or i == 0 else y, [rows, 32]))
            w = w_param if param_weight and i == len(weights) - 1 else relax.const(weight)
            mm = bb.emit(relax.op.matmul(rows_of_x, bb.emit(relax.op.permute_dims(w, [1, 0])), out_dtype="float32"))
            out = bb.emit(relax.op.astype(mm, dtype))
            outs.append(bb.emit(relax.op.sum(out, axis=[1])))
            if matmul_reused and i == 0:
                outs.append(bb.emit(relax.op.astype(bb.emit(relax.op.sum(mm, axis=[1])), dtype)))
        return relax.Tuple(outs)

    return main_module(body, [x, y, w_param])


def matmuls(mod) -> int:
    return mod["main"].script().count("R.matmul")


def run(mod, *arrays):
    vm = VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in arrays])]


def test_layers_sharing_an_input_become_one_matmul_with_the_weights_joined():
    mod = linears()
    after = joined(mod)
    assert matmuls(mod) == 3 and matmuls(after) == 1 and after["main"].script().count("R.strided_slice") == 3
    weights = [c.value.numpy() for c in _constants(after["main"]) if c.value.numpy().shape[0] == 2 * WIDE + 64]
    assert len(weights) == 1 and np.array_equal(weights[0], np.concatenate(WEIGHTS))
    x, y, w = (RNG.standard_normal(s).astype("float16") for s in ([2, 8, 32], [2, 8, 32], [64, 32]))
    for got, want in zip(run(after, x, y, w), run(mod, x, y, w)):
        np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def test_bf16_layers_are_joined_in_bf16():
    mod = linears(dtype="bfloat16")
    after = joined(mod)
    assert matmuls(after) == 1 and 'R.astype(lv' in after["main"].script() and '"float16"' not in after["main"].script()
    (weight,) = [c.value.numpy() for c in _constants(after["main"]) if c.value.numpy().shape[0] == 2 * WIDE + 64]
    assert str(weight.dtype) == "bfloat16"


def test_the_callers_module_is_left_as_it_was():
    mod = linears()
    before = mod["main"].script()
    joined(mod)
    assert mod["main"].script() == before


@pytest.mark.parametrize("options", [
    {"same_input": False, "weights": WEIGHTS[:2]},  # one layer reads x, the other y
    {"param_weight": True, "weights": WEIGHTS[:2]},  # the second weight is given at run time
    {"matmul_reused": True, "weights": WEIGHTS[:2]},  # the float32 product is used beyond its cast
    {"weights": WEIGHTS[:1]},  # one layer
    {"weights": [WEIGHTS[2]] * 3},  # 3 x 64 columns: one tile, joining gains no wave
], ids=["different-inputs", "run-time-weight", "product-reused", "one-layer", "too-few-tiles"])
def test_layers_it_cannot_or_need_not_join_are_left_alone(options):
    mod = linears(**options)
    assert matmuls(joined(mod)) == matmuls(mod)


@pytest.mark.parametrize("rows", [1, "m"])
def test_one_row_or_a_symbolic_row_count_is_joined_however_narrow(rows):
    """One row: a GEMV over the joint weight (one launch, one tail); a symbolic count: its one-row
    kernel is that GEMV. Two layers of one width are concatenated, not interleaved: a gated epilogue
    is the wgmma template's alone."""
    narrow = [WEIGHTS[2], WEIGHTS[2][::-1].copy()]
    after = joined(linears(narrow, rows=rows))
    assert matmuls(after) == 1
    (weight,) = [c.value.numpy() for c in _constants(after["main"]) if c.value.numpy().shape[0] == 128]
    assert np.array_equal(weight, np.concatenate(narrow))


def test_symbolic_joins_match_the_layers_apart():
    mod = linears([WEIGHTS[2]] * 3, rows="m")
    after = joined(mod)
    assert matmuls(after) == 1
    for m in (1, 5):
        x, y, w = (RNG.standard_normal(s).astype("float16") for s in ([m, 1, 32], [m, 1, 32], [64, 32]))
        for got, want in zip(run(after, x, y, w), run(mod, x, y, w)):
            np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def test_cpu_targets_keep_their_layers():
    assert matmuls(joined(linears(), tvm.target.Target("llvm"))) == 3


def test_joined_where_two_waves_of_large_tiles_follow():
    """LLaMA at seq 512 on 132 SMs: gate + up (2 x 11008 columns) joined, q + k + v (3 x 4096) not;
    at seq 2048 both."""
    assert worth_joining(512, 2 * 11008, 132) and not worth_joining(512, 3 * 4096, 132)
    assert worth_joining(2048, 3 * 4096, 132)


def _constants(func) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (GenericConst, found.append), order="pre")
    return found
