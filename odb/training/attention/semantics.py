"""What one attention call asks for, read from its arguments: who sees whom and how scores change
(:class:`Pattern`), the arguments odb_varlen handles (:data:`HANDLED_KWARGS`; any other one with a
value raises), and where the call's samples begin (:func:`call_cu_seqlens`). Also the call counts
by path (:data:`calls`) and the one-time warning of a slower path (:func:`warn_slow`)."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["HANDLED_KWARGS", "calls", "cu_seqlens_from_position_ids"]

# Every keyword argument varlen_attention implements; any other one that arrives not None raises.
HANDLED_KWARGS = frozenset({
    "attention_mask", "dropout", "scaling", "is_causal", "sliding_window", "softcap",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
    "use_cache",  # the layer updates its cache before calling; the lengths check below guards decoding
    "output_attentions",  # False only: no attention weights are returned
    "s_aux",  # gpt-oss's attention sinks: one logit per head
    "output_router_logits",  # MoE layers: a flag for what the layer returns, nothing for attention
    "num_items_in_batch",  # HF Trainer's loss normalizer, which the model's kwargs carry down: not attention's
})


calls: Counter[str] = Counter()
"""Calls of odb_varlen by the path that ran ('flash-attn varlen', 'torch varlen_attn', 'grouped SDPA',
'padded rows'), since import: what a check reports as the path taken (tools/check/gpu_check_attention.py)."""


@dataclass(frozen=True)
class Pattern:
    """What one attention call asked for: who sees whom, and how scores and probabilities change."""

    is_causal: bool
    window: int | None  # a query sees itself and the window - 1 keys before it
    softcap: float | None
    dropout: float
    sinks: bool = False  # s_aux given: the explicit math (the tensor travels beside the pattern)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample starts of rows ``[B, T]`` laid end to end: a sample begins where its position is 0
    and at every row start; returns ``[n + 1]`` int32 ending with ``B * T``."""
    starts = position_ids == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.flatten()).flatten()
    end = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([flat, end]).to(torch.int32)


@lru_cache(maxsize=8)
def warn_slow(reason: str) -> None:
    warnings.warn(f"odb_varlen: {reason}; attention runs per group of samples through SDPA (correct, "
                  "slower)", stacklevel=3)


def check_kwargs(kwargs: dict) -> None:
    unknown = sorted(name for name, value in kwargs.items() if name not in HANDLED_KWARGS and value is not None)
    if unknown:
        raise ValueError(f"odb_varlen does not implement the attention argument(s) {unknown} this model "
                         "passes; train it padded (attn_implementation 'sdpa' or 'eager') or teach "
                         "odb/training/attention/semantics.py (HANDLED_KWARGS) and the kernels those arguments")
    if kwargs.get("output_attentions"):
        raise ValueError("odb_varlen returns no attention weights; drop output_attentions=True")


def call_cu_seqlens(query: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Sample boundaries over the ``B * T`` tokens of the call."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if query.shape[0] != 1:
            raise ValueError(f"cu_seq_lens_q needs one packed row (batch size 1), got {query.shape[0]} rows")
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu and not torch.equal(cu_k.to(cu.device), cu):
            raise ValueError("odb_varlen needs cu_seq_lens_k equal to cu_seq_lens_q (self-attention)")
        return cu
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # each row one sample
        return (torch.arange(query.shape[0] + 1, device=query.device) * query.shape[2]).to(torch.int32)
    if position_ids.shape != (query.shape[0], query.shape[2]):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not mark samples of rows "
                         f"{tuple(query.shape[::2])}; pass cu_seq_lens_q/cu_seq_lens_k")
    return cu_seqlens_from_position_ids(position_ids)
