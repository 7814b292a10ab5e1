"""transformers and DeepSpeed: flags, DeepSpeed config, model, varlen attention, M-RoPE, the
engine (loss math), the LR schedule, and the run. Uses :mod:`odb.data` and :mod:`odb.batching`."""
