"""Schedule templates for fused reduce subgraphs: one module per strategy, `dispatch` picks one."""

from .dispatch import STRATEGIES, contraction_template, heuristic_knobs, plan, schedule, scheduled

__all__ = ["STRATEGIES", "contraction_template", "heuristic_knobs", "plan", "schedule", "scheduled"]
