"""Reproducible measurements behind docs/benchmarks.md."""
