"""Space: every valid knob point of every schedule template for a task, on a target.

Each template lists its points (`knob_space` beside `default_knobs`) from its validity rules, so
an invalid point is never built."""

from __future__ import annotations

from tvm import tirx
from tvm.target import Target

from tvm_ext.schedules.analysis import match
from tvm_ext.schedules.device import device_of
from tvm_ext.schedules.dispatch import STRATEGIES, contraction_template, heuristic_knobs


def knob_space(func: tirx.PrimFunc, target: Target, dims: dict | None = None) -> list[dict]:
    """The points of every strategy that fits `func` on `target`, in the heuristic's strategy order,
    the heuristic's own point (at the symbolic sizes `dims`) first: the tuner's first batch then
    holds what an untuned build runs."""
    return space_and_heuristic(func, target, dims)[0]


def space_and_heuristic(func: tirx.PrimFunc, target: Target, dims: dict | None = None) -> tuple[list[dict], dict | None]:
    """(knob_space, the heuristic's point or None): the heuristic planned once (a symbolic row count's
    class kernels are scheduled to plan it)."""
    device = device_of(target)
    template = contraction_template(func, target) if device.is_gpu else None
    if template is not None:  # the matmul (thread-level or wgmma) or conv2d template's points that fit
        points = template.knob_space(func)
    else:
        pattern = match(func)
        if pattern is None:
            return [], None
        points = [point for strategy in STRATEGIES.values() for point in strategy.knob_space(pattern, device)]
    default = heuristic_knobs(func, target, dims)
    return (points if default is None else [default] + [point for point in points if point != default]), default
