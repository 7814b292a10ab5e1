"""The cluster and long-context simulators (docs/benchmarks.md)."""
