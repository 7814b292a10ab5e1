"""Varlen attention for packed rows, registered with transformers as ``"odb_varlen"``.

A packed row holds several samples back to back (``cu_seqlens`` marks where each begins); each
sample must attend only to itself. transformers' own answer on CPU is a dense ``T x T`` block
mask, which is slower than padding (DESIGN.md measures 7.4k vs 12-16k tokens/s). This module
computes attention per sample instead, and does for each sample what the model asked for:

* ``is_causal`` (the argument, else ``module.is_causal``): decoder layers are causal; the vision
  towers of Qwen2-VL / Qwen2.5-VL / Qwen3-VL call with ``is_causal=False`` (bidirectional).
* ``sliding_window=w`` (Mistral, Qwen2, Gemma-2's sliding layers): the query at position i sees
  keys ``i - w + 1 .. i`` of its own sample, as transformers' ``sliding_window_overlay``.
* ``softcap=c`` (Gemma-2): scores become ``c * tanh(scores / c)`` before the mask and softmax.
* ``dropout=p`` (train mode): dropout on each sample's own attention probabilities.

Paths:

* CUDA, fp16/bf16: the flash-attn package's varlen kernel when installed (everything above);
  else PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (causal, windows, bidirectional; it
  has no dropout and no softcap, so those fall to the grouped path below, with a warning).
* Everywhere else: ``scaled_dot_product_attention`` over groups of samples of similar length, each
  group right-padded *inside attention only* (the MLPs and projections see no padding). Causal
  rows pass ``is_causal=True`` and no mask (real queries never see the padded keys, which all lie
  in their future): the CPU fast path. A window adds a banded mask, bidirectional attention a
  key-padding mask, and softcap a plain ``scores -> tanh -> mask -> softmax`` per group.

Rows with an ``attention_mask`` (the padded baselines) go to transformers' SDPA unchanged: their
mask already holds the window; softcap, which SDPA refuses, takes the per-group math instead.
Any other argument that arrives with a value raises (:data:`HANDLED_KWARGS` lists those handled).
Always run the model with ``use_cache=False`` when training packed rows: with a cache,
transformers 5.24 lets packed samples attend to each other on eager/SDPA (measured, DESIGN.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch
import torch.nn.functional as F

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HANDLED_KWARGS",
    "cu_seqlens_from_position_ids",
    "has_flash_attn",
    "register",
    "varlen_attention",
]

ATTN_IMPLEMENTATION = "odb_varlen"
# Every keyword argument varlen_attention implements; any other one that arrives not None raises.
HANDLED_KWARGS = frozenset({
    "attention_mask", "dropout", "scaling", "is_causal", "sliding_window", "softcap",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
    "use_cache",  # the layer updates its cache before calling; the lengths check below guards decoding
    "output_attentions",  # False only: no attention weights are returned
})
# A group's padded attention area may exceed its real area (sum of L^2) by this factor.
_GROUP_SLACK = 1.3
_plan_cache: list = [None, None]


@dataclass(frozen=True)
class _Pattern:
    """What one attention call asked for: who sees whom, and how scores and probabilities change."""

    is_causal: bool
    window: int | None  # a query sees itself and the window - 1 keys before it
    softcap: float | None
    dropout: float


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample starts of rows ``[B, T]`` laid end to end: a sample begins where its position is 0
    and at every row start; returns ``[n + 1]`` int32 ending with ``B * T``."""
    starts = position_ids == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.flatten()).flatten()
    end = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([flat, end]).to(torch.int32)


def _groups(cu_seqlens: torch.Tensor, total: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Groups of samples of similar length: (index [G, L] into the row, valid [G, L], L)."""
    if _plan_cache[0] is cu_seqlens:
        return _plan_cache[1]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seq_lens_q {bounds} must run from 0 to the row's {total} tokens")
    segments = sorted(((b - a, a) for a, b in pairwise(bounds) if b > a), reverse=True)
    plan, i = [], 0
    while i < len(segments):
        longest, area, j = segments[i][0], 0, i
        while j < len(segments) and (j - i + 1) * longest ** 2 <= _GROUP_SLACK * (area + segments[j][0] ** 2):
            area += segments[j][0] ** 2
            j += 1
        j = max(j, i + 1)
        starts = torch.tensor([a for _, a in segments[i:j]])
        lengths = torch.tensor([n for n, _ in segments[i:j]])
        offsets = torch.arange(longest)
        valid = offsets[None, :] < lengths[:, None]
        index = torch.where(valid, starts[:, None] + offsets[None, :], starts[:, None])
        plan.append((index.to(cu_seqlens.device), valid.to(cu_seqlens.device), longest))
        i = j
    _plan_cache[0], _plan_cache[1] = cu_seqlens, plan
    return plan


@lru_cache(maxsize=8)
def _causal_band(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[1, 1, L, L]`` bool: key j visible to query i when ``i - window < j <= i``."""
    i = torch.arange(length, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return allowed[None, None]


def _allowed(valid: torch.Tensor | None, length: int, pattern: _Pattern, device) -> torch.Tensor | None:
    """Which keys each query of a group may see (bool, broadcast to ``[G, H, L, L]``); None where
    SDPA's ``is_causal`` flag says it all (plain causal) or every key is visible."""
    if not pattern.is_causal:
        return None if valid is None or bool(valid.all()) else valid[:, None, None, :]
    if pattern.window is None and pattern.softcap is None:
        return None
    # Padding lies after each sample, in the future of its real queries: the band excludes it.
    return _causal_band(length, pattern.window, torch.device(device))


def _softcapped(q, k, v, allowed, scaling: float | None, pattern: _Pattern) -> torch.Tensor:
    """Attention with Gemma-2's capped scores, in eager's order (SDPA has no softcap):
    ``q, k, v [G, H(kv), L, D]`` and a bool or additive mask -> ``[G, H, L, D]``."""
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / pattern.softcap) * pattern.softcap
    if allowed is not None:
        # eager's fill value: a fully masked row (left padding) stays finite
        scores = (scores.masked_fill(~allowed, torch.finfo(scores.dtype).min) if allowed.dtype == torch.bool
                  else scores + allowed)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    if pattern.dropout:
        probs = F.dropout(probs, p=pattern.dropout)
    return torch.matmul(probs, v)


def _attend(q, k, v, valid: torch.Tensor | None, scaling: float | None, pattern: _Pattern) -> torch.Tensor:
    """One group: ``q, k, v [G, H(kv), L, D]``, ``valid [G, L]`` (None: no padding) -> ``[G, H, L, D]``."""
    allowed = _allowed(valid, q.shape[2], pattern, q.device)
    if pattern.softcap is not None:
        return _softcapped(q, k, v, allowed, scaling, pattern)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=pattern.dropout,
                                          is_causal=pattern.is_causal and allowed is None, scale=scaling,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _grouped_varlen(q, k, v, cu_seqlens: torch.Tensor, scaling: float | None, pattern: _Pattern) -> torch.Tensor:
    """``q, k, v [T, H(kv), D]`` -> ``[T, H, D]``: each sample attends within itself, samples of
    similar length batched into one SDPA call."""
    if cu_seqlens.numel() == 2:  # one sample (a vision chunk, a single row): no gather
        out = _attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), None, scaling, pattern)
        return out[0].transpose(0, 1)
    out = q.new_empty(q.shape)
    for index, valid, longest in _groups(cu_seqlens, q.shape[0]):
        qg, kg, vg = (t[index].transpose(1, 2) for t in (q, k, v))  # [G, L, H, D] -> [G, H, L, D]
        og = _attend(qg, kg, vg, valid, scaling, pattern)
        out[index[valid]] = og.transpose(1, 2)[valid]
    return out


def _flash_window(pattern: _Pattern) -> tuple[int, int]:
    """Flash Attention's ``(left, right)``: query i sees keys ``i - left .. i + right`` (-1: no
    limit). transformers' window w keeps ``i - w < j <= i``, so left = w - 1."""
    if not pattern.is_causal:
        return -1, -1
    return (pattern.window - 1 if pattern.window is not None else -1), 0


@lru_cache(maxsize=8)
def _warn_slow(reason: str) -> None:
    warnings.warn(f"odb_varlen: {reason}; attention runs per group of samples through SDPA (correct, "
                  "slower). `pip install flash-attn` for the fused varlen kernel", stacklevel=3)


@lru_cache(maxsize=1)
def _flash_attn_varlen():
    """flash-attn's varlen kernel, or None when the optional package is not installed (looked up
    once: a failed import is not cached by Python and would search the path in every layer)."""
    try:  # softcap needs flash-attn >= 2.6
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def has_flash_attn() -> bool:
    """Whether the optional flash-attn package serves odb_varlen on GPU."""
    return _flash_attn_varlen() is not None


def _cuda_varlen(q, k, v, cu_seqlens, max_seqlen: int, scaling, pattern: _Pattern) -> torch.Tensor | None:
    """``q, k, v [T, H(kv), D]`` through a Flash Attention varlen kernel; None where no installed
    kernel computes what ``pattern`` asks for."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    flash_attn_varlen_func = _flash_attn_varlen()
    if flash_attn_varlen_func is not None:
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=pattern.dropout,
                                      softmax_scale=scaling, causal=pattern.is_causal,
                                      window_size=_flash_window(pattern), softcap=pattern.softcap or 0.0)
    if pattern.dropout or pattern.softcap is not None:
        _warn_slow("torch's varlen_attn has no dropout and no softcap, and flash-attn is not installed")
        return None
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scaling, window_size=_flash_window(pattern),
                       enable_gqa=q.shape[1] != k.shape[1])


def _check_kwargs(kwargs: dict) -> None:
    unknown = sorted(name for name, value in kwargs.items() if name not in HANDLED_KWARGS and value is not None)
    if unknown:
        raise ValueError(f"odb_varlen does not implement the attention argument(s) {unknown} this model "
                         "passes; train it padded (attn_implementation 'sdpa' or 'eager') or teach "
                         "odb/training/attention.py those arguments")
    if kwargs.get("output_attentions"):
        raise ValueError("odb_varlen returns no attention weights; drop output_attentions=True")


def _cu_seqlens(query: torch.Tensor, kwargs: dict) -> torch.Tensor:
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


def _padded(module, query, key, value, attention_mask, scaling, pattern: _Pattern, kwargs: dict):
    """Rows with a mask (the padded baselines): the mask transformers built holds causality and
    the window; transformers' SDPA, or the softcap math SDPA lacks."""
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("got both an attention_mask and cu_seq_lens_q: pass one (padded rows or a packed row)")
    if pattern.softcap is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=pattern.dropout,
                                      scaling=scaling, is_causal=pattern.is_causal, **kwargs)
    out = _softcapped(query, key, value, attention_mask, scaling, pattern)
    return out.transpose(1, 2).contiguous(), None


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers attention interface: ``query [B, H, T, D]`` -> ``(out [B, T, H, D], None)``.

    Samples are given by ``cu_seq_lens_q`` (one packed row), else by ``position_ids`` restarting
    at 0, else each row is one sample.

    Raises:
        ValueError: an argument this function does not implement, a bidirectional window, or
            query and key lengths that differ (decoding with a cache: use SDPA to generate).
    """
    _check_kwargs(kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is not None and not is_causal:
        raise ValueError("odb_varlen has no bidirectional sliding_window (transformers' own kernels disagree "
                         "on its width); train this model padded (attn_implementation 'eager')")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"odb_varlen is for training passes: {query.shape[2]} queries but {key.shape[2]} keys "
                         "(a KV cache); run with use_cache=False, or generate with attn_implementation 'sdpa'")
    pattern = _Pattern(bool(is_causal), sliding_window, softcap or None, float(dropout))
    if attention_mask is not None:
        return _padded(module, query, key, value, attention_mask, scaling, pattern, kwargs)
    cu_seqlens = _cu_seqlens(query, kwargs)
    batch, heads, length, _ = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value))
    out = None
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        max_seqlen = kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = _cuda_varlen(q, k, v, cu_seqlens, int(max_seqlen), scaling, pattern)
    elif query.is_cuda:
        _warn_slow(f"Flash Attention kernels need fp16/bf16, got {query.dtype}")
    if out is None:
        out = _grouped_varlen(q, k, v, cu_seqlens, scaling, pattern)
    return out.reshape(batch, length, heads, -1), None


def _mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (attention follows cu_seqlens); SDPA's mask for padded ones."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Registers ``"odb_varlen"`` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)
    return ATTN_IMPLEMENTATION
