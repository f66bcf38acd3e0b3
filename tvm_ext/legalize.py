"""Legalizations the pipeline uses in place of TVM's defaults."""

from __future__ import annotations

from tvm import relax, topi


def _softmax_float32_accumulate(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """TVM's softmax sums exp() in the input dtype; in fp16 a 32k-wide row loses ~3 digits.

    Compute in float32 and cast back, as PyTorch does; the casts fuse away into the kernel.
    """
    axis = int(call.attrs.axis)

    def softmax(x):
        return topi.cast(topi.nn.softmax(topi.cast(x, "float32"), axis=axis), x.dtype)

    return bb.call_te(softmax, call.args[0], primfunc_name_hint="softmax")


LEGALIZE = {"relax.nn.softmax": _softmax_float32_accumulate}
