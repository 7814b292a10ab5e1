"""Varlen attention for packed rows, registered with transformers as ``"odb_varlen"``.

A packed row holds several samples back to back (``cu_seqlens`` marks where each begins); each
sample must attend only to itself. transformers' own answer on CPU is a dense ``T x T`` block
mask, which is slower than padding (docs/design.md, attention semantics). This module
computes attention per sample instead, and does for each sample what the model asked for:

* ``is_causal`` (the argument, else ``module.is_causal``): decoder layers are causal; the vision
  towers of Qwen2-VL / Qwen2.5-VL / Qwen3-VL call with ``is_causal=False`` (bidirectional).
* ``sliding_window=w`` (Mistral, Qwen2, Gemma-2's sliding layers): the query at position i sees
  keys ``i - w + 1 .. i`` of its own sample, as transformers' ``sliding_window_overlay``.
* ``softcap=c`` (Gemma-2): scores become ``c * tanh(scores / c)`` before the mask and softmax.
* ``dropout=p`` (train mode): dropout on each sample's own attention probabilities.
* ``s_aux`` (gpt-oss's attention sinks, one learned logit ``s_h`` per head): the sink joins each
  query's softmax denominator and is dropped after, as gpt-oss's eager attention does::

      p_ij = exp(z_ij) / (sum_{j' visible} exp(z_ij') + exp(s_h))     out_i = sum_j p_ij v_j

* ``output_router_logits`` (the MoE families: Qwen2/3-MoE, OLMoE, Mixtral, gpt-oss): a flag that
  only tells the layer what to return; nothing to do here (:mod:`odb.training.moe` adds the
  router loss).

Paths:

* CUDA, fp16/bf16: the flash-attn package's varlen kernel when installed (all of the above but
  sinks: flash-attn 2.x's ``flash_attn_varlen_func`` has none); else PyTorch's
  ``torch.nn.attention.varlen.varlen_attn`` (causal, windows, bidirectional; no dropout, softcap
  or sinks), called with what the installed release's signature has (:mod:`odb.training.cuda_varlen`).
  What a kernel cannot compute falls to the grouped path below, with a one-time warning.
* Everywhere else: ``scaled_dot_product_attention`` over groups of samples of similar length, each
  group right-padded *inside attention only* (the MLPs and projections see no padding). Causal
  rows pass ``is_causal=True`` and no mask (real queries never see the padded keys, which all lie
  in their future): the CPU fast path. A window adds a banded mask, bidirectional attention a
  key-padding mask, and softcap or sinks the plain ``scores -> tanh -> mask -> [sink] softmax``
  per group (:func:`_explicit`).

Rows with an ``attention_mask`` (the padded baselines) go to transformers' SDPA unchanged: their
mask already holds the window; softcap and sinks, which SDPA lacks, take the per-group math.
:func:`attention_path` names the path a device takes (the start banner) after one checked call.
Any other argument that arrives with a value raises (:data:`HANDLED_KWARGS` lists those handled).
Always run the model with ``use_cache=False`` when training packed rows: with a cache,
transformers 5.24 lets packed samples attend to each other on eager/SDPA (measured; docs/design.md).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch
import torch.nn.functional as F

from odb.training import cuda_varlen

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HANDLED_KWARGS",
    "attention_path",
    "calls",
    "cu_seqlens_from_position_ids",
    "has_flash_attn",
    "register",
    "route_through",
    "varlen_attention",
]

ATTN_IMPLEMENTATION = "odb_varlen"
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
'padded rows'), since import: what a check reports as the path taken (tools/gpu_check_attention.py)."""
# A group's padded attention area may exceed its real area (sum of L^2) by this factor.
_GROUP_SLACK = 1.3
_plan_cache: list = [None, None]
_around: list = [None]  # sequence parallelism's call around varlen_attention (route_through)


@dataclass(frozen=True)
class _Pattern:
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


@dataclass(frozen=True)
class _RowPlan:
    """How a packed row's samples are laid out for the grouped path: groups of samples of similar
    length, each group ``[G, L]`` (its samples right-padded to its longest, ``L``), laid end to end
    in one buffer of ``P = sum G * L`` positions.

    Attributes:
        gather: ``[P]`` the row position each buffer position reads (a pad reads its sample's first
            token: causal queries never see it, and its output is never read).
        scatter: ``[T]`` the buffer position of each row token, in row order.
        shapes: per group ``(G, L)``.
        sizes: per group its positions in the buffer, ``G * L`` (the split of the buffer).
        valid: per group ``[G, L]`` bool, the real (not padded) positions.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    shapes: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    valid: tuple[torch.Tensor, ...]


def _groups(cu_seqlens: torch.Tensor, total: int) -> _RowPlan:
    """The row's groups of samples of similar length (cached for the row's ``cu_seqlens``: every
    layer of a forward reuses them)."""
    if _plan_cache[0] is cu_seqlens:
        return _plan_cache[1]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seq_lens_q {bounds} must run from 0 to the row's {total} tokens")
    segments = sorted(((b - a, a) for a, b in pairwise(bounds) if b > a), reverse=True)
    gather, valid, shapes, scatter = [], [], [], torch.empty(total, dtype=torch.long)
    i, at = 0, 0
    while i < len(segments):
        longest, area, j = segments[i][0], 0, i
        while j < len(segments) and (j - i + 1) * longest ** 2 <= _GROUP_SLACK * (area + segments[j][0] ** 2):
            area += segments[j][0] ** 2
            j += 1
        j = max(j, i + 1)
        starts = torch.tensor([a for _, a in segments[i:j]])
        lengths = torch.tensor([n for n, _ in segments[i:j]])
        offsets = torch.arange(longest)
        real = offsets[None, :] < lengths[:, None]
        index = torch.where(real, starts[:, None] + offsets[None, :], starts[:, None])
        scatter[index[real]] = at + torch.nonzero(real.flatten()).flatten()
        gather.append(index.flatten())
        valid.append(real.to(cu_seqlens.device))
        shapes.append((j - i, longest))
        at += (j - i) * longest
        i = j
    device = cu_seqlens.device
    plan = _RowPlan(torch.cat(gather).to(device), scatter.to(device), tuple(shapes),
                    tuple(size * longest for size, longest in shapes), tuple(valid))
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
    if pattern.window is None and pattern.softcap is None and not pattern.sinks:
        return None
    # Padding lies after each sample, in the future of its real queries: the band excludes it.
    return _causal_band(length, pattern.window, torch.device(device))


def _explicit(q, k, v, allowed, scaling: float | None, pattern: _Pattern, sinks: torch.Tensor | None) -> torch.Tensor:
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


def _attend(q, k, v, valid: torch.Tensor | None, scaling: float | None, pattern: _Pattern,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """One group: ``q, k, v [G, H(kv), L, D]``, ``valid [G, L]`` (None: no padding) -> ``[G, H, L, D]``."""
    allowed = _allowed(valid, q.shape[2], pattern, q.device)
    if pattern.softcap is not None or sinks is not None:
        return _explicit(q, k, v, allowed, scaling, pattern, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=pattern.dropout,
                                          is_causal=pattern.is_causal and allowed is None, scale=scaling,
                                          enable_gqa=q.shape[1] != k.shape[1])


class _LayOut(torch.autograd.Function):
    """``x [T, ...] -> x[gather] [P, ...]``, the row laid out in groups (:class:`_RowPlan`), whose
    backward is a gather too: ``grad_x = grad[scatter]``, each token's gradient read from its one
    real position. The padded positions' gradients are left out: they are exactly zero, as
    nothing real sees a pad (it lies in every real query's future, or is masked) and no pad's
    output is read (the output gather reads real positions only). Autograd's own backward of
    ``index_select`` would add them in, filling and scattering into a buffer of zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gather: torch.Tensor, scatter: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scatter)
        return x.index_select(0, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scatter,) = ctx.saved_tensors
        return grad.index_select(0, scatter), None, None


def _grouped_varlen(q, k, v, cu_seqlens: torch.Tensor, scaling: float | None, pattern: _Pattern,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """``q, k, v [T, H(kv), D]`` -> ``[T, H, D]``: each sample attends within itself, samples of
    similar length batched into one SDPA call (or one explicit computation).

    One gather per input lays every group out in one buffer (:class:`_LayOut`, whose backward is a
    gather too), and one gather reads the outputs back in row order (:class:`_RowPlan`), whatever
    the number of groups."""
    if cu_seqlens.numel() == 2:  # one sample (a vision chunk, a single row): no gather
        out = _attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), None, scaling, pattern, sinks)
        return out[0].transpose(0, 1)
    plan = _groups(cu_seqlens, q.shape[0])
    # [P, H(kv), D] each, split into the groups' [G * L, H(kv), D] (a split's backward is one
    # concatenation; a slice's would fill a zero buffer of all P positions per group)
    gather, scatter = plan.gather.to(q.device), plan.scatter.to(q.device)  # (no copy where already there)
    chunks = [_LayOut.apply(t, gather, scatter).split(plan.sizes) for t in (q, k, v)]
    outs = []
    for (size, longest), valid, *group in zip(plan.shapes, plan.valid, *chunks):
        qg, kg, vg = (g.view(size, longest, *g.shape[1:]).transpose(1, 2) for g in group)
        og = _attend(qg, kg, vg, valid, scaling, pattern, sinks)  # [G, H, L, D]
        outs.append(og.transpose(1, 2).reshape(size * longest, og.shape[1], og.shape[3]))
    # (in SDPA's dtype, not q's: under autocast, bf16 on a CPU)
    return torch.cat(outs).index_select(0, scatter)


def _flash_window(pattern: _Pattern) -> tuple[int, int]:
    """Flash Attention's ``(left, right)`` for ``pattern`` (:func:`odb.training.cuda_varlen.flash_window`)."""
    return cuda_varlen.flash_window(pattern.is_causal, pattern.window)


@lru_cache(maxsize=8)
def _warn_slow(reason: str) -> None:
    warnings.warn(f"odb_varlen: {reason}; attention runs per group of samples through SDPA (correct, "
                  "slower)", stacklevel=3)


def has_flash_attn() -> bool:
    """Whether the optional flash-attn package serves odb_varlen on GPU."""
    return cuda_varlen.flash_attn_varlen() is not None


def _cuda_varlen(q, k, v, cu_seqlens, max_seqlen: int, scaling, pattern: _Pattern) -> torch.Tensor | None:
    """``q, k, v [T, H(kv), D]`` through a Flash Attention varlen kernel; None where no installed
    kernel computes what ``pattern`` asks for (the caller runs the grouped path)."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if pattern.sinks:
        _warn_slow("no installed Flash Attention varlen kernel has attention sinks (s_aux)")
        return None
    flash_attn_varlen_func = cuda_varlen.flash_attn_varlen()
    if flash_attn_varlen_func is not None:
        calls["flash-attn varlen"] += 1
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=pattern.dropout,
                                      softmax_scale=scaling, causal=pattern.is_causal,
                                      window_size=_flash_window(pattern), softcap=pattern.softcap or 0.0)
    if pattern.dropout or pattern.softcap is not None:
        _warn_slow("torch's varlen_attn has no dropout and no softcap, and flash-attn is not installed "
                   "(`pip install flash-attn` for the fused kernel)")
        return None
    api = cuda_varlen.torch_varlen_api()
    if api is None:
        _warn_slow(f"torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not installed "
                   "(torch >= 2.12 or flash-attn for a fused varlen kernel)")
        return None
    out = cuda_varlen.call_torch_varlen(api, q, k, v, cu, max_seqlen, scale=scaling, is_causal=pattern.is_causal,
                                        window=pattern.window)
    if out is None:
        _warn_slow(f"torch {torch.__version__}'s varlen_attn has no window_size (sliding windows), and flash-attn "
                   "is not installed")
    else:
        calls["torch varlen_attn"] += 1
    return out


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


def _padded(module, query, key, value, attention_mask, scaling, pattern: _Pattern, sinks, kwargs: dict):
    """Rows with a mask (the padded baselines): the mask transformers built holds causality and
    the window; transformers' SDPA, or the softcap / sink math SDPA lacks."""
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("got both an attention_mask and cu_seq_lens_q: pass one (padded rows or a packed row)")
    if pattern.softcap is None and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=pattern.dropout,
                                      scaling=scaling, is_causal=pattern.is_causal, **kwargs)
    out = _explicit(query, key, value, attention_mask, scaling, pattern, sinks)
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
    kwargs.pop("output_router_logits", None)
    sinks = kwargs.pop("s_aux", None)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is not None and not is_causal:
        raise ValueError("odb_varlen has no bidirectional sliding_window (transformers' own kernels disagree "
                         "on its width); train this model padded (attn_implementation 'eager')")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"odb_varlen is for training passes: {query.shape[2]} queries but {key.shape[2]} keys "
                         "(a KV cache); run with use_cache=False, or generate with attn_implementation 'sdpa'")
    pattern = _Pattern(bool(is_causal), sliding_window, softcap or None, float(dropout), sinks is not None)
    if attention_mask is not None:
        calls["padded rows"] += 1
        return _padded(module, query, key, value, attention_mask, scaling, pattern, sinks, kwargs)
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
        calls["grouped SDPA"] += 1
        out = _grouped_varlen(q, k, v, cu_seqlens, scaling, pattern, sinks)
    return out.reshape(batch, length, heads, -1), None


_GROUPED = "SDPA per group of similar-length samples"
# max |out - SDPA| in the start check, by dtype (outputs are averages of values of order 1)
_CHECK_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def attention_path(device: torch.device, dtype: torch.dtype) -> str:
    """The path odb_varlen takes for packed rows on ``device`` in ``dtype``, in words for the start banner (e.g.
    'flash-attn 2.8.3 varlen', 'torch varlen_attn (is_causal; K/V heads expanded)', 'SDPA per group of similar-length
    samples'). On CUDA it runs one tiny packed call through that path and compares it with SDPA on each sample alone.
    Raises RuntimeError naming the fix (the torch or flash-attn version to install, or what to uninstall) when the
    path cannot run (e.g. flash-attn installed but failing to import or to run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _GROUPED
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{_GROUPED} (Flash Attention kernels need fp16/bf16, not {str(dtype).removeprefix('torch.')})"
    return _kernel_path(device, dtype)


def _kernel_path(device: torch.device, dtype: torch.dtype) -> str:
    """:func:`attention_path` for a device whose fp16/bf16 packed rows go to :func:`_cuda_varlen`."""
    install = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    error = cuda_varlen.flash_attn_error()
    if error is not None:
        raise RuntimeError(f"flash-attn {cuda_varlen.flash_attn_version()} is installed but fails to import ({error}): "
                           f"install the flash-attn build for {install}, or `pip uninstall flash-attn` (odb then "
                           "uses torch's varlen_attn)")
    api = cuda_varlen.torch_varlen_api()
    if has_flash_attn():
        name = f"flash-attn {cuda_varlen.flash_attn_version()} varlen"
        fix = f"install the flash-attn build for {install}, or `pip uninstall flash-attn` (odb then uses torch's)"
    elif api is not None:
        name = api.describe()
        fix = ("install torch >= 2.12 (varlen_attn with scale, window_size and enable_gqa) or flash-attn; on a GPU "
               "older than Ampere (no Flash Attention kernels) train in fp32, which takes the per-group SDPA path")
    else:
        return (f"{_GROUPED} (torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not "
                "installed: torch >= 2.12 or flash-attn for a fused kernel)")
    try:
        diffs = {f"window {w}" if w else "causal": _check_kernel(device, dtype, w) for w in (None, 4)}
    except Exception as error:  # a kernel not built for this GPU, a signature odb does not know, ...
        raise RuntimeError(f"odb_varlen's CUDA path ({name}) fails on {device} in {dtype}: "
                           f"{type(error).__name__}: {error}; {fix}") from error
    tolerance = _CHECK_TOLERANCE[dtype]
    wrong = {case: diff for case, diff in diffs.items() if diff is not None and not diff <= tolerance}
    if wrong:
        raise RuntimeError(f"odb_varlen's CUDA path ({name}) differs from SDPA on each sample alone on {device} in "
                           f"{dtype}: max abs diff {wrong} > {tolerance}; {fix}")
    return name


def _check_kernel(device: torch.device, dtype: torch.dtype, window: int | None) -> float | None:
    """Max |out - SDPA per sample| of one packed call (4 samples, GQA 4:2, a scale other than
    ``1/sqrt(D)``) through :func:`_cuda_varlen`; None where the kernel leaves it to the grouped path."""
    gen = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim, scale = (5, 17, 1, 9), 4, 2, 64, 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(lengths), heads, dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lengths), kv_heads, dim, generator=gen).to(device, dtype) for _ in range(2))
    pattern = _Pattern(True, window, None, 0.0)
    with torch.no_grad():
        out = _cuda_varlen(q, k, v, cu, max(lengths), scale, pattern)
        if out is None:
            return None
        bounds = cu.tolist()
        expected = []
        for start, end in pairwise(bounds):
            qs, ks, vs = (t[start:end].transpose(0, 1).float()[None] for t in (q, k, v))
            allowed = _causal_band(end - start, window, torch.device(device))
            expected.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale,
                                                           enable_gqa=True)[0].transpose(0, 1))
        return float((out.float() - torch.cat(expected)).abs().max())


def route_through(around) -> None:
    """Makes ``"odb_varlen"`` call ``around(module, query, key, value, attention_mask, **kwargs)``
    instead of :func:`varlen_attention` (which ``around`` calls in turn): sequence parallelism's
    all-to-all (:mod:`odb.training.sequence_parallel`); None routes calls straight again."""
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
