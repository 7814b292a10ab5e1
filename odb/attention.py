"""Varlen attention for packed rows, registered with transformers as ``"odb_varlen"``.

A packed row holds several samples back to back (``cu_seqlens`` marks where each begins); each
sample must attend only to itself, causally. transformers' own answer on CPU is a dense
``T x T`` block mask, which is slower than padding (DESIGN.md measures 7.4k vs 12-16k tokens/s).
This module computes attention per sample instead:

* CUDA: Flash Attention varlen over ``cu_seqlens``, from PyTorch itself
  (``torch.nn.attention.varlen.varlen_attn``) or from the flash-attn package when installed.
* CPU: ``scaled_dot_product_attention`` over groups of samples of similar length, each group
  right-padded *inside attention only* (with a causal mask, real queries never see the padded
  keys, which all lie in their future); the MLPs and projections still see no padding.

Rows with an ``attention_mask`` (the padded baselines) go to transformers' SDPA unchanged.
Always run the model with ``use_cache=False`` when training packed rows: with a cache,
transformers 5.24 lets packed samples attend to each other (measured, DESIGN.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ATTN_IMPLEMENTATION", "register", "varlen_attention", "cu_seqlens_from_position_ids"]

ATTN_IMPLEMENTATION = "odb_varlen"
# A group's padded attention area may exceed its real area (sum of L^2) by this factor.
_GROUP_SLACK = 1.3
_plan_cache: list = [None, None]


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample starts of a packed row ``[1, T]`` whose positions restart at 0 per sample."""
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    end = torch.tensor([position_ids.shape[1]], device=position_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


def _groups(cu_seqlens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Groups of samples of similar length: (index [G, L] into the row, valid [G, L], L)."""
    if _plan_cache[0] is cu_seqlens:
        return _plan_cache[1]
    bounds = cu_seqlens.tolist()
    segments = sorted(((b - a, a) for a, b in zip(bounds, bounds[1:]) if b > a), reverse=True)
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


def _cpu_varlen(query, key, value, cu_seqlens, scaling):
    # query [1, H, T, D], key/value [1, Hkv, T, D] -> output [1, T, H, D]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    out = q.new_empty(q.shape)
    gqa = q.shape[1] != k.shape[1]
    for index, valid, longest in _groups(cu_seqlens):
        # [G, L, H, D] -> [G, H, L, D]
        qg, kg, vg = (t[index].transpose(1, 2) for t in (q, k, v))
        og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scaling, enable_gqa=gqa)
        out[index[valid]] = og.transpose(1, 2)[valid]
    return out.unsqueeze(0)


def _cuda_varlen(query, key, value, cu_seqlens, max_seqlen, scaling):
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H, D]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    try:
        from flash_attn import flash_attn_varlen_func  # the optional 'gpu' extra

        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scaling, causal=True)
    except ImportError:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scaling, window_size=(-1, 0),
                          enable_gqa=q.shape[1] != k.shape[1])
    return out.unsqueeze(0)


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs):
    """transformers attention interface: ``query [B, H, T, D]`` -> ``(out [B, T, H, D], None)``."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if attention_mask is not None or query.shape[0] != 1 or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if cu_seqlens is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(query.shape[2], device=query.device)[None]
        cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    if query.is_cuda:
        max_seqlen = kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return _cuda_varlen(query, key, value, cu_seqlens, int(max_seqlen), scaling), None
    return _cpu_varlen(query, key, value, cu_seqlens, scaling), None


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
