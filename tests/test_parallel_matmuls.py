"""Linear layers sharing an input joined into one matmul: what is joined, what is left, and the
numbers (CPU) before and after."""

import numpy as np
import pytest
import tvm
from tvm import relax
import tvm_ffi
from tvm.ir.expr import GenericConst
from tvm.runtime.vm import VirtualMachine

from bench.spelled import main_module
from tvm_ext.parallel_matmuls import combine_parallel_linears

RNG = np.random.default_rng(0)
WEIGHTS = [(RNG.standard_normal((n, 32)) / 8).astype("float16") for n in (48, 16, 64)]


def linears(weights=WEIGHTS, same_input=True, param_weight=False, matmul_reused=False) -> tvm.IRModule:
    """sum of x @ W_i^T over the layers, each Linear spelled as the frontend writes it: its own
    reshape of x to rows, matmul in float32 by the permuted weight, astype fp16."""
    x = relax.Var("x", relax.TensorType([2, 8, 32], "float16"))
    y = relax.Var("y", relax.TensorType([2, 8, 32], "float16"))
    w_param = relax.Var("w", relax.TensorType(list(weights[0].shape), "float16"))

    def body(bb, x, y, w_param):
        outs = []
        for i, weight in enumerate(weights):
            rows = bb.emit(relax.op.reshape(x if same_input or i == 0 else y, [16, 32]))
            w = w_param if param_weight and i == 0 else relax.const(weight)
            mm = bb.emit(relax.op.matmul(rows, bb.emit(relax.op.permute_dims(w, [1, 0])), out_dtype="float32"))
            out = bb.emit(relax.op.astype(mm, "float16"))
            outs.append(bb.emit(relax.op.sum(out, axis=[1])))
            if matmul_reused and i == 0:
                outs.append(bb.emit(relax.op.astype(bb.emit(relax.op.sum(mm, axis=[1])), "float16")))
        return relax.Tuple(outs)

    return main_module(body, [x, y, w_param])


def matmuls(mod) -> int:
    return mod["main"].script().count("R.matmul")


def run(mod, *arrays):
    vm = VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in arrays])]


def test_layers_sharing_an_input_become_one_matmul_with_the_weights_joined():
    mod = linears()
    after = combine_parallel_linears(mod)
    assert matmuls(mod) == 3 and matmuls(after) == 1 and after["main"].script().count("R.strided_slice") == 3
    joined = [c.value.numpy() for c in _constants(after["main"]) if c.value.numpy().shape[0] == 128]
    assert len(joined) == 1 and np.array_equal(joined[0], np.concatenate(WEIGHTS))
    x, y, w = (RNG.standard_normal(s).astype("float16") for s in ([2, 8, 32], [2, 8, 32], [48, 32]))
    for got, want in zip(run(after, x, y, w), run(mod, x, y, w)):
        np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def test_the_callers_module_is_left_as_it_was():
    mod = linears()
    before = mod["main"].script()
    combine_parallel_linears(mod)
    assert mod["main"].script() == before


@pytest.mark.parametrize("options", [
    {"same_input": False, "weights": WEIGHTS[:2]},  # one layer reads x, the other y
    {"param_weight": True, "weights": WEIGHTS[:2]},  # a weight given at run time cannot be joined at compile time
    {"matmul_reused": True, "weights": WEIGHTS[:2]},  # the float32 product is used beyond its cast
    {"weights": WEIGHTS[:1]},  # one layer
], ids=["different-inputs", "run-time-weight", "product-reused", "one-layer"])
def test_layers_it_cannot_join_are_left_alone(options):
    mod = linears(**options)
    assert matmuls(combine_parallel_linears(mod)) == matmuls(mod)


def test_imported_llama_joins_q_k_v_and_gate_up():
    torch = pytest.importorskip("torch")
    import tvm_ext  # noqa: PLC0415
    from examples.torch_models import LlamaLayer  # noqa: PLC0415

    mod = tvm_ext.from_torch(LlamaLayer(256, 2, 512).eval().half(), torch.randn(1, 64, 256).half())
    after = combine_parallel_linears(mod)
    assert matmuls(mod) == 9 and matmuls(after) == 6  # q, k, v -> 1; gate, up -> 1; o, down and attention's 2 stay
    assert "R.Tensor((64, 768)" in after["main"].script() and "R.Tensor((64, 1024)" in after["main"].script()


def _constants(func) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (GenericConst, found.append), order="pre")
    return found
