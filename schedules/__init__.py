"""Schedule templates for fused reduce subgraphs: one module per strategy, `dispatch` picks one."""

from .dispatch import STRATEGIES, gpu_contraction, heuristic_knobs, plan, schedule, scheduled

__all__ = ["STRATEGIES", "gpu_contraction", "heuristic_knobs", "plan", "schedule", "scheduled"]
