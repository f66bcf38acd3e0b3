"""The suite's ops as Relax modules, with float64 NumPy references and effective-byte counts.

Shared by the benchmark, the tests and the demo so that all three exercise the same graphs.
"""

from __future__ import annotations

import json
import os

import numpy as np
from tvm import relax, tirx

SUITE = os.path.join(os.path.dirname(__file__), "suite.json")
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}


def load_suite(path: str = SUITE) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["cases"]


def input_shapes(op: str, shape: list) -> list:
    """Shapes of all inputs: x first, then the per-column weight (and bias)."""
    return {"layer_norm": [shape, shape[-1:], shape[-1:]], "rms_norm": [shape, shape[-1:]]}.get(op, [shape])


def _relax_body(op: str, args: list):
    x = args[0]
    o = relax.op
    if op == "layer_norm":
        return o.nn.layer_norm(x, args[1], args[2], axes=[-1], epsilon=EPS[op])
    if op == "rms_norm":
        return o.nn.rms_norm(x, args[1], axes=[-1], epsilon=EPS[op])
    if op == "softmax":
        return o.nn.softmax(x, axis=-1)
    if op == "bn_stats":
        return relax.Tuple([o.mean(x, axis=[0, 2, 3]), o.variance(x, axis=[0, 2, 3])])
    if op == "row_sum":
        return o.sum(x, axis=[1])
    if op == "col_sum":
        return o.sum(x, axis=[0])
    if op == "full_sum":
        return o.sum(x)
    raise ValueError(f"unknown suite op {op!r}")


def relax_module(op: str, shape: list, dtype: str):
    """`main(x[, w, b])` for one suite op; string dims in `shape` become symbolic int64 vars."""
    syms = {d: tirx.Var(d, "int64") for d in shape if isinstance(d, str)}
    dims = [syms[d] if isinstance(d, str) else d for d in shape]
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(s, dtype)) for i, s in enumerate(input_shapes(op, dims))]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(_relax_body(op, params))
        bb.emit_func_output(out)
    return bb.get()


def concrete_shape(shape: list, values: dict) -> list[int]:
    return [values[d] if isinstance(d, str) else d for d in shape]


def random_inputs(op: str, shape: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    """float32 inputs (cast by the caller); x is not centred so one-pass variance would show."""
    return [rng.standard_normal(s).astype("float32") * 2 + 0.5 for s in input_shapes(op, shape)]


def reference(op: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """float64 results of `op`, as a list of outputs."""
    a = [np.asarray(t, dtype="float64") for t in arrays]
    x = a[0]
    if op == "layer_norm":
        return [(x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS[op]) * a[1] + a[2]]
    if op == "rms_norm":
        return [x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS[op]) * a[1]]
    if op == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        return [e / e.sum(-1, keepdims=True)]
    if op == "bn_stats":
        return [x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))]
    if op == "row_sum":
        return [x.sum(1)]
    if op == "col_sum":
        return [x.sum(0)]
    if op == "full_sum":
        return [np.asarray(x.sum())]
    raise ValueError(f"unknown suite op {op!r}")


def effective_bytes(op: str, shape: list[int], dtype: str) -> int:
    """Bytes that must cross HBM at least once: x read, plus the output when it is x-sized."""
    elems = int(np.prod(shape))
    size = np.dtype("float16").itemsize if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    writes_x_sized = op in ("layer_norm", "rms_norm", "softmax")
    return elems * size * (2 if writes_x_sized else 1)
