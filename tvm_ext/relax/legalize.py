"""Legalizations the pipeline uses in place of TVM's defaults."""

from __future__ import annotations

from functools import reduce

import tvm
from tvm import relax, te, tirx, topi
from tvm.target import Target

from tvm_ext.schedules import grid_sync
from tvm_ext.schedules.device import device_of
from tvm_ext.schedules.rows import stage_limit

from . import online_softmax, welford


def _softmax_float32_accumulate(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """TVM's softmax sums exp() in the input dtype; in fp16 a 32k-wide row loses ~3 digits.

    Compute in float32 (float64 in float64) and cast back, as PyTorch does; the casts fuse away
    into the kernel. Rows a GPU kernel will re-read from memory take the online form (one pass for
    the statistics, online_softmax.py); rows it stages keep max, then sum, read from the stage.
    """
    axis = int(call.attrs.axis)
    if _rows_reread(call.args[0], axis):
        return bb.call_te(online_softmax.softmax_te, call.args[0], axis, primfunc_name_hint="softmax")

    def softmax(x):
        return topi.cast(topi.nn.softmax(topi.cast(x, welford.accumulator(x.dtype)), axis=axis), x.dtype)

    return bb.call_te(softmax, call.args[0], primfunc_name_hint="softmax")


def _rows_reread(x: relax.Expr, axis: int) -> bool:
    """Whether the GPU row templates will read softmax's rows of `x` from memory for each pass:
    over the last axis, a static row larger than a block's stage (schedules.rows.stage_limit),
    unless the rows are few enough for grid_sync, which stages each block's chunk of its row.
    Symbolic widths keep max, then sum: their width classes re-read rows too, but the online
    form measured 0.98-1.13x there, and slower on few short float32 rows, where its serial
    update is the time (docs/design.md#online-softmax)."""
    target = Target.current(allow_none=True)
    ndim = x.ty.ndim
    if target is None or target.kind.name != "cuda" or ndim < 1 or axis % ndim != ndim - 1 or x.ty.shape is None:
        return False
    *rows, width = x.ty.shape.values
    if not isinstance(width, tirx.IntImm):
        return False
    device = device_of(target)
    if all(isinstance(d, tirx.IntImm) for d in rows) \
            and 2 * reduce(lambda a, b: a * int(b), rows, 1) <= grid_sync.cooperative_slots(device, grid_sync.THREADS):
        return False
    return int(width) * tvm.runtime.DataType(x.ty.dtype).bits // 8 > stage_limit(device)


def _layer_norm_float32(variance: str):
    """LayerNorm computed in float32 (float64 in float64) whatever the input dtype, as PyTorch does, with its
    statistics from `variance` (see welford.statistics_te): Welford reads x once for both.

    TVM's own (C++ TOPI) refuses bfloat16 and applies the weight and bias in float16.
    """

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        eps = float(call.attrs.epsilon)
        algorithm = welford.algorithm_for(call, variance)

        def layer_norm(x, gamma, beta):
            axes = sorted(int(a) % len(x.shape) for a in call.attrs.axes)
            param_shape = [x.shape[i] if i in axes else 1 for i in range(len(x.shape))]
            mean, var = welford.statistics_te(x, axes, algorithm)
            kept = [1 if i in axes else x.shape[i] for i in range(len(x.shape))]
            return _normalize(x, mean, var, eps, kept, gamma, beta, param_shape)

        return bb.call_te(layer_norm, *call.args, primfunc_name_hint="layer_norm")

    return legalize


def _rms_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """RMSNorm. TVM's own (C++ TOPI) computes in float32 whatever the input, so float64 comes out
    with float32's error; float64 is computed in float64 here, other dtypes keep TVM's."""
    if call.args[0].ty.dtype != "float64":
        return tvm.ir.Op.get("relax.nn.rms_norm").get_attr("FLegalize")(bb, call)
    eps = float(call.attrs.epsilon)

    def rms_norm(x, weight):
        axes = sorted(int(a) % len(x.shape) for a in call.attrs.axes)
        count = reduce(lambda a, b: a * b, [x.shape[a] for a in axes]).astype(x.dtype)
        squares = topi.sum(topi.multiply(x, x), axis=axes, keepdims=True)
        scale = topi.rsqrt(topi.add(topi.divide(squares, count), tirx.const(eps, x.dtype)))
        return topi.multiply(topi.multiply(x, scale),
                             topi.reshape(weight, [x.shape[i] if i in axes else 1 for i in range(len(x.shape))]))

    return bb.call_te(rms_norm, *call.args, primfunc_name_hint="rms_norm")


def _variance(algorithm: str):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        return bb.call_te(welford.variance_te, call.args[0], welford.axes_of(call), bool(call.attrs.keepdims),
                          welford.algorithm_for(call, algorithm), primfunc_name_hint="variance")

    return legalize


def _normalize(x, mean, var, eps: float, kept: list, scale=None, shift=None, param_shape=None):
    """(x - mean) * rsqrt(var + eps) [* scale] [+ shift] in welford.accumulator(x.dtype), cast back
    to x's dtype; mean and var come without the reduced dims and are broadcast through `kept` (1 on
    reduced dims)."""
    acc = welford.accumulator(x.dtype)
    mean, var = topi.reshape(mean, kept), topi.reshape(var, kept)
    y = topi.multiply(topi.subtract(topi.cast(x, acc), mean), topi.rsqrt(topi.add(var, tirx.const(eps, acc))))
    if scale is not None:
        y = topi.multiply(y, topi.reshape(topi.cast(scale, acc), param_shape))
    if shift is not None:
        y = topi.add(y, topi.reshape(topi.cast(shift, acc), param_shape))
    return topi.cast(y, x.dtype)


def _std(algorithm: str):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        def std(x):
            axes = welford.axes_of(call)
            var = welford.statistics_te(x, axes, welford.algorithm_for(call, algorithm))[1]
            out = topi.cast(topi.sqrt(var), x.dtype)
            return welford.keep_dims(out, x, axes) if call.attrs.keepdims else out

        return bb.call_te(std, call.args[0], primfunc_name_hint="std")

    return legalize


def _statistics(bb: relax.BlockBuilder, call: relax.Call, x_expr, view, axes, algorithm: str, name: str):
    """(mean, variance) of `view(x)` over `axes` in float32, as their own kernel: one reduction
    (Welford by default) that our row strategies schedule, separate from the normalisation, whose
    loops run over x's layout, not the statistics' rows."""

    def statistics(x):
        return list(welford.statistics_te(view(x), axes, welford.algorithm_for(call, algorithm)))

    stats = bb.emit(bb.call_te(statistics, x_expr, primfunc_name_hint=name))
    return relax.TupleGetItem(stats, 0), relax.TupleGetItem(stats, 1)


def _batch_norm_training(algorithm: str):
    """Training-mode batch norm: the batch statistics in one reduction kernel, then the
    normalisation and the moving-average updates, as TVM's TOPI defines them. Inference mode has
    no reduction and keeps TVM's own legalization."""
    default = tvm.ir.Op.get("relax.nn.batch_norm").get_attr("FLegalize")

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        attrs = call.attrs
        if not attrs.training:
            return default(bb, call)
        momentum = float(attrs.momentum)
        rank = len(call.args[0].ty.shape.values)
        axis = int(attrs.axis) % rank
        mean, var = _statistics(bb, call, call.args[0], lambda x: x, [i for i in range(rank) if i != axis], algorithm,
                                "batch_norm_statistics")

        def batch_norm(x, gamma, beta, moving_mean, moving_var, mean, var):
            kept = [x.shape[i] if i == axis else 1 for i in range(rank)]
            out = _normalize(x, mean, var, float(attrs.epsilon), kept, gamma if attrs.scale else None,
                             beta if attrs.center else None, kept)

            def moving(old, new):
                acc = welford.accumulator(old.dtype)
                return topi.cast(topi.add(topi.multiply(topi.cast(old, acc), tirx.const(1 - momentum, acc)),
                                          topi.multiply(new, tirx.const(momentum, acc))), old.dtype)

            return [out, moving(moving_mean, mean), moving(moving_var, var)]

        return bb.call_te(batch_norm, *call.args, mean, var, primfunc_name_hint="batch_norm")

    return legalize


def _instance_norm(algorithm: str):
    """Instance norm over `axes`, per `channel_axis`: the frontend's form of PyTorch's training-mode
    batch norm (axes (0, 2, 3)). TVM's own computes the variance as E[x^2] - E[x]^2 in the same
    loop as the normalisation; here the statistics are one reduction kernel, as for batch norm."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        attrs = call.attrs
        rank = len(call.args[0].ty.shape.values)
        axes = sorted(int(a) % rank for a in attrs.axes)
        mean, var = _statistics(bb, call, call.args[0], lambda x: x, axes, algorithm, "instance_norm_statistics")
        param_shape = [call.args[0].ty.shape.values[i] if i == int(attrs.channel_axis) % rank else 1
                       for i in range(rank)]

        def instance_norm(x, gamma, beta, mean, var):
            kept = [1 if i in axes else x.shape[i] for i in range(rank)]
            return _normalize(x, mean, var, float(attrs.epsilon), kept, gamma if attrs.scale else None,
                              beta if attrs.center else None, param_shape)

        return bb.call_te(instance_norm, *call.args, mean, var, primfunc_name_hint="instance_norm")

    return legalize


class _GroupedView:
    """x with its channel axis read as (groups, channels per group), indexed without a tensor of
    its own: a reshape (or a copy block) between x and the statistics reduction keeps TVM from
    matching the reduction's reducer or normalising its block."""

    def __init__(self, x, channel: int, per_group: int, shape: list):
        self.x, self.channel, self.per_group, self.dtype = x, channel, per_group, x.dtype
        self.shape = [tirx.const(d, "int64") for d in shape]

    def __getitem__(self, index):
        c = self.channel
        return self.x[tuple(index[:c]) + (index[c] * self.per_group + index[c + 1],) + tuple(index[c + 2:])]


def _group_norm(algorithm: str):
    """Group norm: statistics of each (batch, group) over its channels and `axes` in one
    reduction kernel (the channel axis viewed as (groups, channels per group)), then the
    normalisation with per-channel gamma and beta."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        attrs = call.attrs
        groups = int(attrs.num_groups)
        shape = [int(d) for d in call.args[0].ty.shape.values]
        rank = len(shape)
        channel = int(attrs.channel_axis) % rank
        per_group = shape[channel] // groups
        split = shape[:channel] + [groups, per_group] + shape[channel + 1:]
        reduced = sorted([a + 1 if a > channel else a for a in (int(a) % rank for a in attrs.axes)] + [channel + 1])
        def grouped(x):
            return _GroupedView(x, channel, per_group, split)

        mean, var = _statistics(bb, call, call.args[0], grouped, reduced, algorithm, "group_norm_statistics")

        def group_norm(x, gamma, beta, mean, var):
            kept = [1 if i in reduced else split[i] for i in range(len(split))]
            param_shape = [split[i] if i in (channel, channel + 1) else 1 for i in range(len(split))]
            out = _normalize(topi.reshape(x, split), mean, var, float(attrs.epsilon), kept,
                             topi.reshape(gamma, [groups, per_group]), topi.reshape(beta, [groups, per_group]),
                             param_shape)
            return topi.reshape(out, shape)

        return bb.call_te(group_norm, *call.args, mean, var, primfunc_name_hint="group_norm")

    return legalize


def legalize_full(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """relax.full / full_like. TVM 0.27's own legalization hands TOPI the dtype as a PrimType and
    fails ("argument of type 'PrimType' is not iterable"); PyTorch's causal masks come through it."""
    dtype = str(call.ty.dtype)
    shape = call.args[0].ty.shape if call.op.name == "relax.full_like" else call.args[0]
    if not isinstance(shape, relax.ShapeExpr):
        raise ValueError(f"{call.op.name} with a shape known only at run time is not supported")
    fill = call.args[1]
    if isinstance(fill, tvm.ir.expr.GenericConst):
        value = tirx.const(fill.value.numpy().item(), dtype)
        return bb.call_te(lambda: te.compute(shape.values, lambda *_: value, name="T_full"), primfunc_name_hint="full")
    return bb.call_te(lambda f: te.compute(shape.values, lambda *_: f().astype(dtype), name="T_full"), fill,
                      primfunc_name_hint="full")


def legalize_power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """x ** c for a constant whole c from 1 to 4 as a product of x's, as PyTorch computes it.

    TVM compiles CUDA with --use_fast_math, where powf is __powf, exp2(c * log2(x)): NaN for every
    negative x, even for x ** 2 (LLaMA's RMSNorm squares its input with pow: all its outputs were
    NaN on the GPU). Other exponents keep TVM's legalization.
    """
    exponent = call.args[1]
    if isinstance(exponent, tvm.ir.expr.GenericConst) and exponent.value.numpy().size == 1:
        c = float(exponent.value.numpy().item())
        if c.is_integer() and 1 <= c <= MAX_PRODUCT_EXPONENT:
            def power(x):
                y = x
                for _ in range(int(c) - 1):
                    y = topi.multiply(y, x)
                return topi.cast(y, str(call.ty.dtype))

            return bb.call_te(power, call.args[0], primfunc_name_hint="power")
    return tvm.ir.Op.get("relax.power").get_attr("FLegalize")(bb, call)


MAX_PRODUCT_EXPONENT = 4
VARIANCE_ALGORITHMS = ("welford", "two_pass", "one_pass")


def legalize_strided_slice(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """relax.strided_slice with its negative axes counted from the front. TVM's legalization takes a
    negative axis only for static shapes; with a symbolic dim it fails ("Check failed: axis <
    src_tensor_dim (-1 vs. 2)"): GPT-2 built for any batch slices its position ids with dim=-1."""
    x, axes, *rest = call.args
    ndim = x.ty.ndim
    if ndim > 0 and isinstance(axes, relax.Tuple) and any(int(a.value) < 0 for a in axes.fields):
        call = relax.op.strided_slice(x, [int(a.value) % ndim for a in axes.fields], *rest,
                                      assume_inbound=call.attrs.assume_inbound)
    return tvm.ir.Op.get("relax.strided_slice").get_attr("FLegalize")(bb, call)


def legalizations(variance: str = "welford") -> dict:
    """Op name -> legalization for the pipeline.

    `variance`: "welford" (one pass, stable), "two_pass" (the mean, then squared deviations; for
    `relax.variance` TVM's own legalization), or the naive "one_pass" E[x^2]-E[x]^2 (for comparison
    only: it cancels catastrophically when the mean is large). It applies to variance, std,
    LayerNorm, training-mode batch norm and group norm.
    """
    if variance not in VARIANCE_ALGORITHMS:
        raise ValueError(f"unknown variance algorithm {variance!r}: expected one of {VARIANCE_ALGORITHMS}")
    table = {"relax.nn.softmax": _softmax_float32_accumulate, "relax.nn.layer_norm": _layer_norm_float32(variance),
             "relax.nn.rms_norm": _rms_norm, "relax.std": _std(variance),
             "relax.nn.batch_norm": _batch_norm_training(variance),
             "relax.nn.group_norm": _group_norm(variance), "relax.full": legalize_full, "relax.full_like": legalize_full,
             "relax.power": legalize_power, "relax.nn.instance_norm": _instance_norm(variance),
             "relax.strided_slice": legalize_strided_slice}
    if variance != "two_pass":
        table["relax.variance"] = _variance(variance)
    return table
