"""Norms and softmax spelled out the way models write them, as Relax modules with NumPy references.

Each pattern rounds where PyTorch code would (`.float()` up front, `.to(fp16)` before the weight),
and its reference rounds at the same places, so a fused kernel must keep those casts to match.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx

op = relax.op
EPS = 1e-6


def _f32(v):
    return relax.const(v, "float32")


def rms_norm_llama(bb, x, w):
    """x.float().pow(2).mean(-1, keepdim=True); x * rsqrt(. + eps); .to(x.dtype) * w"""
    xf = bb.emit(op.astype(x, "float32"))
    r = bb.emit(op.rsqrt(op.add(op.mean(op.power(xf, _f32(2.0)), axis=[-1], keepdims=True), _f32(EPS))))
    return op.multiply(op.astype(op.multiply(xf, r), x.ty.dtype), w)


def layer_norm_spelled(bb, x, w, b):
    xf = bb.emit(op.astype(x, "float32"))
    centred = bb.emit(op.subtract(xf, op.mean(xf, axis=[-1], keepdims=True)))
    var = bb.emit(op.mean(op.multiply(centred, centred), axis=[-1], keepdims=True))
    y = op.divide(centred, op.sqrt(op.add(var, _f32(EPS))))
    return op.add(op.multiply(op.astype(y, x.ty.dtype), w), b)


def softmax_spelled(bb, x):
    e = bb.emit(op.exp(op.subtract(x, op.max(x, axis=[-1], keepdims=True))))
    return op.divide(e, op.sum(e, axis=[-1], keepdims=True))


def add_rms_norm(bb, x, residual, w):
    """(h, rms_norm(h)) with h = x + residual: the pre-norm block of a transformer layer."""
    h = bb.emit(op.add(x, residual))
    return relax.Tuple([h, bb.emit(rms_norm_llama(bb, h, w))])


def rms_norm_silu(bb, x, w):
    """SiLU after the LLaMA RMSNorm (an activation the norm's kernel must absorb)."""
    y = bb.emit(rms_norm_llama(bb, x, w))
    return op.multiply(y, op.sigmoid(y))


def layer_norm_gelu(bb, x, w, b):
    return op.nn.gelu(op.nn.layer_norm(x, w, b, axes=[-1], epsilon=EPS))


def _round(a, dtype):
    return a.astype(dtype).astype("float32")


def _rms_ref(x, w):
    xf = x.astype("float32")
    r = 1 / np.sqrt((xf ** 2).mean(-1, keepdims=True) + EPS)
    return _round(_round(xf * r, x.dtype) * w.astype("float32"), x.dtype)


def _ln_ref(x, w, b):
    xf = x.astype("float32")
    centred = xf - xf.mean(-1, keepdims=True)
    y = _round(centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + EPS), x.dtype)
    return _round(_round(y * w.astype("float32"), x.dtype) + b.astype("float32"), x.dtype)


def _softmax_ref(x):
    e = np.exp(x.astype("float32") - x.astype("float32").max(-1, keepdims=True))
    return _round(e / e.sum(-1, keepdims=True), x.dtype)


def _gelu_ln_ref(x, w, b):
    from math import erf  # noqa: PLC0415

    xf = x.astype("float32")
    y = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + EPS) * w + b
    return _round(0.5 * y * (1 + np.vectorize(erf)(y / np.sqrt(2))), x.dtype)


PATTERNS = {
    # name: (relax body, inputs beside x: "w" weight / "r" residual of x's shape, reference)
    "rms_norm_llama": (rms_norm_llama, "w", _rms_ref),
    "layer_norm_spelled": (layer_norm_spelled, "wb", _ln_ref),
    "softmax_spelled": (softmax_spelled, "", _softmax_ref),
    "add_rms_norm": (add_rms_norm, "rw", lambda x, r, w: [_round(x.astype("float32") + r, x.dtype), _rms_ref(
        _round(x.astype("float32") + r, x.dtype).astype(x.dtype), w)]),
    "layer_norm_gelu": (layer_norm_gelu, "wb", _gelu_ln_ref),
    "rms_norm_silu": (rms_norm_silu, "w", lambda x, w: _round(_rms_ref(x, w) / (1 + np.exp(-_rms_ref(x, w))), x.dtype)),
}


def module(name: str, shape: list, dtype: str):
    """`main(x, ...)` for a pattern; string dims in `shape` become symbolic."""
    body, extra, _ = PATTERNS[name]
    dims = [tirx.Var(d, "int64") if isinstance(d, str) else d for d in shape]
    params = [relax.Var("x", relax.TensorType(dims, dtype))] + [
        relax.Var(k, relax.TensorType(dims if k == "r" else dims[-1:], dtype)) for k in extra]
    return main_module(body, params)


def main_module(body, params: list):
    """`main(*params)` returning `body(bb, *params)`, in one dataflow block."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def inputs(name: str, shape: list, dtype: str, rng) -> list[np.ndarray]:
    _, extra, _ = PATTERNS[name]
    return [rng.standard_normal(shape if k in "xr" else shape[-1:]).astype("float32").astype(dtype) for k in "x" + extra]


def reference(name: str, arrays: list) -> list[np.ndarray]:
    out = PATTERNS[name][2](*arrays)
    return out if isinstance(out, list) else [out]
