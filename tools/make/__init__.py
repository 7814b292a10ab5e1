"""What makes the bundled data, the benchmarks' trace data and docs/settings.md's tables."""
