"""Schedule templates for fused reduce subgraphs: one module per strategy, `dispatch` picks one."""

from .dispatch import (STRATEGIES, class_rows, contraction_kernels, contraction_template, heuristic_knobs, plan, schedule,
                       scheduled, symbolic_rows, tunable)

__all__ = ["STRATEGIES", "class_rows", "contraction_kernels", "contraction_template", "heuristic_knobs", "plan", "schedule", "scheduled",
           "symbolic_rows", "tunable"]
