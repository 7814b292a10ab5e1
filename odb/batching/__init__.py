"""The pure batching core: stdlib and numpy only (no torch, no transformers, no I/O).

Config and cost model, packers and padded baselines, the uid stream and its sharding policies,
the round decision, wire formats, the alignment (every collective, behind ``Communicator``),
the per-rank batcher (data through a ``Feed``), its state, and a simulator of N ranks in one
process. Testable without a GPU, a model or a process group.
"""
