"""Legalizations the pipeline uses in place of TVM's defaults."""

from __future__ import annotations

from tvm import relax, tirx, topi

from . import welford


def _softmax_float32_accumulate(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """TVM's softmax sums exp() in the input dtype; in fp16 a 32k-wide row loses ~3 digits.

    Compute in float32 and cast back, as PyTorch does; the casts fuse away into the kernel.
    """
    axis = int(call.attrs.axis)

    def softmax(x):
        return topi.cast(topi.nn.softmax(topi.cast(x, "float32"), axis=axis), x.dtype)

    return bb.call_te(softmax, call.args[0], primfunc_name_hint="softmax")


def _layer_norm_float32(variance: str):
    """LayerNorm computed in float32 whatever the input dtype, as PyTorch does, with its
    statistics from `variance` (see welford.statistics_te): Welford reads x once for both.

    TVM's own (C++ TOPI) refuses bfloat16 and applies the weight and bias in float16.
    """

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        eps = float(call.attrs.epsilon)
        algorithm = "two_pass" if welford.bf16_off_gpu(call) else variance

        def layer_norm(x, gamma, beta):
            axes = sorted(int(a) % len(x.shape) for a in call.attrs.axes)
            param_shape = [x.shape[i] if i in axes else 1 for i in range(len(x.shape))]
            mean, var = welford.statistics_te(x, axes, algorithm)
            kept = [1 if i in axes else x.shape[i] for i in range(len(x.shape))]
            mean, var = topi.reshape(mean, kept), topi.reshape(var, kept)
            y = topi.multiply(topi.subtract(topi.cast(x, "float32"), mean),
                              topi.rsqrt(topi.add(var, tirx.const(eps, "float32"))))
            y = topi.multiply(y, topi.reshape(topi.cast(gamma, "float32"), param_shape))
            y = topi.add(y, topi.reshape(topi.cast(beta, "float32"), param_shape))
            return topi.cast(y, x.dtype)

        return bb.call_te(layer_norm, *call.args, primfunc_name_hint="layer_norm")

    return legalize


def _variance(algorithm: str):
    one_pass_form = {"welford": welford.legalize_variance, "one_pass": welford.legalize_one_pass_variance}[algorithm]

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        if welford.bf16_off_gpu(call):
            return bb.call_te(welford.two_pass_variance_te, call.args[0], welford.axes_of(call),
                              bool(call.attrs.keepdims), primfunc_name_hint="variance")
        return one_pass_form(bb, call)

    return legalize


VARIANCE_ALGORITHMS = ("welford", "two_pass", "one_pass")


def legalizations(variance: str = "welford") -> dict:
    """Op name -> legalization for the pipeline.

    `variance`: "welford" (one pass, stable), TVM's own "two_pass", or the naive "one_pass"
    E[x^2]-E[x]^2 (for comparison only: it cancels catastrophically when the mean is large).
    """
    if variance not in VARIANCE_ALGORITHMS:
        raise ValueError(f"unknown variance algorithm {variance!r}: expected one of {VARIANCE_ALGORITHMS}")
    welford.register()
    table = {"relax.nn.softmax": _softmax_float32_accumulate, "relax.nn.layer_norm": _layer_norm_float32(variance)}
    if variance != "two_pass":
        table["relax.variance"] = _variance(variance)
    return table
