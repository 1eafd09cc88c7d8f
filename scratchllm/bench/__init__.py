"""Benchmarks: each prints our figure beside a baseline measured in the same run, as a ratio."""
