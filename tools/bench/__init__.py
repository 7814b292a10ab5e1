"""Benchmarks: each one's figures are in docs/benchmarks.md beside the command that made them."""
