"""The attention function transformers calls for ``"odb_varlen"`` (:func:`varlen_attention`): a
packed row to the CUDA kernels or the grouped path, padded rows to SDPA; and its registration
with transformers' attention and mask interfaces (:func:`register`). The package docstring
(:mod:`odb.training.attention`) states the semantics and the paths."""

from __future__ import annotations

import torch

from odb.training.attention.cuda import cuda_varlen_attention
from odb.training.attention.explicit import explicit_attention
from odb.training.attention.grouped import grouped_varlen
from odb.training.attention.semantics import Pattern, call_cu_seqlens, calls, check_kwargs, warn_slow

__all__ = ["ATTN_IMPLEMENTATION", "register", "route_through", "varlen_attention"]

ATTN_IMPLEMENTATION = "odb_varlen"


_around: list = [None]  # sequence parallelism's call around varlen_attention (route_through)


def _padded(module, query, key, value, attention_mask, scaling, pattern: Pattern, sinks, kwargs: dict):
    """Rows with a mask (the padded baselines): the mask transformers built holds causality and
    the window; transformers' SDPA, or the softcap / sink math SDPA lacks."""
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("got both an attention_mask and cu_seq_lens_q: pass one (padded rows or a packed row)")
    if pattern.softcap is None and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=pattern.dropout,
                                      scaling=scaling, is_causal=pattern.is_causal, **kwargs)
    out = explicit_attention(query, key, value, attention_mask, scaling, pattern, sinks)
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
    check_kwargs(kwargs)
    kwargs.pop("output_router_logits", None)
    sinks = kwargs.pop("s_aux", None)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is not None and not is_causal:
        raise ValueError("odb_varlen has no bidirectional sliding_window (transformers' own kernels disagree "
                         "on its width); train this model padded (attn_implementation 'eager')")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"odb_varlen is for training passes: {query.shape[2]} queries but {key.shape[2]} keys "
                         "(a KV cache); run with use_cache=False, or generate with attn_implementation 'sdpa'")
    pattern = Pattern(bool(is_causal), sliding_window, softcap or None, float(dropout), sinks is not None)
    if attention_mask is not None:
        calls["padded rows"] += 1
        return _padded(module, query, key, value, attention_mask, scaling, pattern, sinks, kwargs)
    cu_seqlens = call_cu_seqlens(query, kwargs)
    batch, heads, length, _ = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value))
    out = None
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        max_seqlen = kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = cuda_varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), scaling, pattern)
    elif query.is_cuda:
        warn_slow(f"Flash Attention kernels need fp16/bf16, got {query.dtype}")
    if out is None:
        calls["grouped SDPA"] += 1
        out = grouped_varlen(q, k, v, cu_seqlens, scaling, pattern, sinks)
    return out.reshape(batch, length, heads, -1), None


def route_through(around) -> None:
    """Makes ``"odb_varlen"`` call ``around(module, query, key, value, attention_mask, **kwargs)``
    instead of :func:`varlen_attention` (which ``around`` calls in turn): sequence parallelism's
    all-to-all (:mod:`odb.training.step.sequence_parallel`); None routes calls straight again."""
    _around[0] = around


def _entry(module, query, key, value, attention_mask, **kwargs):
    """What transformers calls for ``"odb_varlen"``: :func:`varlen_attention`, or the route around it."""
    around = _around[0]
    if around is None:
        return varlen_attention(module, query, key, value, attention_mask, **kwargs)
    return around(module, query, key, value, attention_mask, **kwargs)


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

    AttentionInterface.register(ATTN_IMPLEMENTATION, _entry)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)
    return ATTN_IMPLEMENTATION
