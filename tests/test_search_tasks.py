"""Task extraction: keys shared by same-structure functions, weights counting call sites."""

from tvm import relax

import tvm_ext
from bench.suite import relax_module
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.records import task_key


def two_layer_norms_and_a_softmax():
    bb = relax.BlockBuilder()
    x, y = (relax.Var(n, relax.TensorType([64, 1024], "float16")) for n in ("x", "y"))
    g, b = (relax.Var(n, relax.TensorType([1024], "float16")) for n in ("g", "b"))
    with bb.function("main", [x, y, g, b]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1]))
            k = bb.emit(relax.op.nn.layer_norm(y, g, b, axes=[-1]))
            out = bb.emit_output(relax.Tuple([h, k, relax.op.nn.softmax(x, axis=-1)]))
        bb.emit_func_output(out)
    return bb.get()


def test_same_structure_is_one_task_weighted_by_its_call_sites():
    tasks = extract_tasks(two_layer_norms_and_a_softmax(), {"kind": "cuda", "arch": "sm_90"})
    assert [(t.weight, "layer_norm" in t.name) for t in tasks] == [(2, True), (1, False)]
    assert len({t.key for t in tasks}) == 2 and all(t.key.endswith("-cuda-sm_90") for t in tasks)


def test_key_is_the_one_the_build_looks_up():
    target = tvm_ext.parse_target("llvm")
    (task,) = extract_tasks(relax_module("rms_norm", ["n", 4096], "float32"), target)
    assert task.key == task_key(task.func, target) and task.key.endswith("-llvm")
    (again,) = extract_tasks(relax_module("rms_norm", ["m", 4096], "float32"), target)
    assert again.key == task.key, "symbolic dims are kept symbolic, whatever their names"
