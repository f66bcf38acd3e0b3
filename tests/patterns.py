"""Reductions outside the suite, each with a NumPy reference: the templates must stay correct there too."""

import numpy as np
from tvm import relax

op = relax.op
PATTERNS = {
    # name: (input shape, relax body, numpy reference)
    "sum_middle_axis": ([6, 300, 40], lambda x: op.sum(x, axis=[1]), lambda a: a.sum(1)),
    "mean_last_two": ([20, 30, 70], lambda x: op.mean(x, axis=[1, 2]), lambda a: a.mean((1, 2))),
    "max_rows": ([50, 777], lambda x: op.max(x, axis=[1]), lambda a: a.max(1)),
    "min_keepdims": ([9, 4100], lambda x: op.min(x, axis=[1], keepdims=True), lambda a: a.min(1, keepdims=True)),
    "argmax_rows": ([33, 1500], lambda x: op.argmax(x, axis=1), lambda a: a.argmax(1)),
    "exp_sum": ([64, 2049], lambda x: op.sum(op.exp(x), axis=[1]), lambda a: np.exp(a).sum(1)),
    "log_softmax": ([17, 3000], lambda x: op.nn.log_softmax(x, axis=-1),
                    lambda a: a - a.max(-1, keepdims=True) - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True))),
}


def module(name):
    shape, body, _ = PATTERNS[name]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(x))
        bb.emit_func_output(out)
    return bb.get()


def check(name, vm, device, rng):
    import tvm  # noqa: PLC0415

    shape, _, ref = PATTERNS[name]
    xs = rng.standard_normal(shape).astype("float32")
    got = vm["main"](tvm.runtime.tensor(xs, device)).numpy()
    want = ref(xs.astype("float64"))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
