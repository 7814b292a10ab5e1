"""Masks of a group of samples, and attention in eager's order for what SDPA lacks.

:func:`allowed_keys` is which keys each query of a group may see (causal, a sliding window, key
padding); :func:`explicit_attention` computes ``scores -> softcap -> mask -> [sink] softmax``:
Gemma-2's capped scores and gpt-oss's attention sinks, exactly as their eager attention does."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from odb.training.attention.semantics import Pattern


@lru_cache(maxsize=8)
def causal_band(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[1, 1, L, L]`` bool: key j visible to query i when ``i - window < j <= i``."""
    i = torch.arange(length, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return allowed[None, None]


def allowed_keys(valid: torch.Tensor | None, length: int, pattern: Pattern, device) -> torch.Tensor | None:
    """Which keys each query of a group may see (bool, broadcast to ``[G, H, L, L]``); None where
    SDPA's ``is_causal`` flag says it all (plain causal) or every key is visible."""
    if not pattern.is_causal:
        return None if valid is None or bool(valid.all()) else valid[:, None, None, :]
    if pattern.window is None and pattern.softcap is None and not pattern.sinks:
        return None
    # Padding lies after each sample, in the future of its real queries: the band excludes it.
    return causal_band(length, pattern.window, torch.device(device))


def explicit_attention(q, k, v, allowed, scaling: float | None, pattern: Pattern,
                       sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention in eager's order, for what SDPA lacks (Gemma-2's capped scores, gpt-oss's sinks):
    ``q, k, v [G, H(kv), L, D]`` and a bool or additive mask -> ``[G, H, L, D]``::

        z = q k^T * scale;  z = cap * tanh(z / cap) (softcap);  z = mask(z)
        p = softmax([z, s_h])[..., :-1]  (sinks: the sink logit s_h of head h joins each row's
                                          denominator and is dropped after)  else softmax(z)
    """
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if pattern.softcap is not None:
        scores = torch.tanh(scores / pattern.softcap) * pattern.softcap
    if allowed is not None:
        # eager's fill value: a fully masked row (left padding) stays finite
        scores = (scores.masked_fill(~allowed, torch.finfo(scores.dtype).min) if allowed.dtype == torch.bool
                  else scores + allowed)
    if sinks is None:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(scores.shape[0], -1, scores.shape[2], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    if pattern.dropout:
        probs = F.dropout(probs, p=pattern.dropout)
    return torch.matmul(probs, v)
