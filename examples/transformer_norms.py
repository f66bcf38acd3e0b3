"""An example model: the norm and softmax traffic of a transformer block, with a symbolic row count.

    h = LayerNorm(x) ; p = Softmax(h) ; r = RMSNorm(x) ; s = rowsum(p * r)
"""

import numpy as np
from tvm import relax, tirx

HIDDEN = 512


def build_module(dtype: str = "float32") -> "tvm.IRModule":  # noqa: F821
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, HIDDEN], dtype))
    g, b, w = (relax.Var(name, relax.TensorType([HIDDEN], dtype)) for name in ("gamma", "beta", "w"))
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            p = bb.emit(relax.op.nn.softmax(h, axis=-1))
            r = bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-6))
            s = bb.emit(relax.op.sum(relax.op.multiply(p, r), axis=[1]))
            out = bb.emit_output(relax.Tuple([p, r, s]))
        bb.emit_func_output(out)
    return bb.get()


def inputs(rows: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((rows, HIDDEN)).astype("float32") * 3 + 1] + [
        rng.standard_normal(HIDDEN).astype("float32") for _ in range(3)]


def reference(x, g, b, w) -> list[np.ndarray]:
    x, g, b, w = (a.astype("float64") for a in (x, g, b, w))
    h = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    e = np.exp(h - h.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    r = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    return [p, r, (p * r).sum(1)]
