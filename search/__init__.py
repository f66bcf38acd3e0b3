"""The tuner: task extraction, search space, features, XGBoost cost model, strategy, measurement.

It writes tuning logs through `tvm_ext.records`; the build pipeline reads them without importing
this package. See docs/design.md#search-tasks-space-cost-model-tuner."""
