"""Benchmark harness and the public suite of fused reduce subgraphs."""
