"""The tuner: task extraction, search space, features, XGBoost cost model, strategy, measurement.

It writes tuning logs through `tvm_ext.records`; the build pipeline reads them without importing
this package. Built so far: `tasks.py` (the fused reduce subgraphs of a model, keyed and weighted)
`space.py` (every valid knob point of the templates), `features.py` (what the cost model sees of
a candidate), `cost_model.py` (XGBoost ranking), `measure.py` (isolated, checked timing) and
`strategy.py` (model-guided batches for one task, logged); the task scheduler across tasks and the
tuning script arrive with the rest of the search issue.
"""
