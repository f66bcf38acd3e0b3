"""The tuner: task extraction, search space, features, XGBoost cost model, strategy, measurement.

It writes tuning logs through `tvm_ext.records`; the build pipeline reads them without importing
this package. Its components arrive with the search issue; nothing here is used yet.
"""
