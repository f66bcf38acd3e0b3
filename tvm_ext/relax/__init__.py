"""Relax graph rewrites, legalizations and fusion: what the pipeline does to a model before its
kernels are scheduled (attention, joined and gated linears, float math around reductions, layout
rewrites, split-K, Welford statistics, reduce-centric fusion, kernel variants per shape class)."""
