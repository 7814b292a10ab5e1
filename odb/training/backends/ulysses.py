"""DeepSpeed's Ulysses attention over groups of consecutive ranks: the library half of sequence
parallelism (:mod:`odb.training.step.sequence_parallel`), under either backend.

``UlyssesSPAttentionHF`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``, DeepSpeed's Arctic
Long Sequence Training) takes an attention function of the transformers interface and runs it on
the whole row: an all-to-all over the group before (a rank's ``T/S`` tokens of all heads -> all
``T`` tokens of ``H/S`` heads; KV heads replicated where ``S`` exceeds them), the function, an
all-to-all back, and an all-gather of the position ids, which the wrapped function receives whole.
DeepSpeed's own ``register_with_transformers`` would form the groups through its global
``parallel_state_sp`` and replace a registered attention; odb builds the module on its own group
and odb's attention calls it (:func:`odb.training.attention.varlen.route_through`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ulysses_attention"]


def ulysses_attention(attention: Callable[..., Any], text_config, size: int, *, rank: int, world_size: int
                      ) -> tuple[Callable[..., Any], Any]:
    """Forms the groups of ``size`` consecutive ranks (collective: every rank, once) and returns
    ``(call, group)``: ``call(module, query, key, value, attention_mask=None, **kwargs)`` runs
    ``attention`` over this rank's group's whole row, and ``group`` is that group (the model's
    device backend: NCCL on GPUs, gloo on CPUs)."""
    import deepspeed.comm
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if not deepspeed.comm.is_initialized():  # (FSDP2) DeepSpeed's collectives over torch's process group
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world_size, size)]
    group = groups[rank // size]
    heads = text_config.num_attention_heads
    ulysses = UlyssesSPAttentionHF(
        attention, batch_size=1, attn_head_count=heads,
        attn_head_size=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        kv_head_count=getattr(text_config, "num_key_value_heads", None) or heads,
        num_hidden_layers=text_config.num_hidden_layers, process_group=group, seq_length_is_variable=True)

    def call(module, query, key, value, attention_mask=None, **kwargs):
        return ulysses(module, query, key, value, attention_mask, **kwargs)

    return call, group
