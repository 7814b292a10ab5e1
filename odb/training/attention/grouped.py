"""The grouped path (CPU, and what no CUDA kernel computes): ``scaled_dot_product_attention`` over
groups of samples of similar length, each group right-padded inside attention only.

:func:`grouped_varlen` lays a packed row out in groups with one gather (:class:`_RowPlan`, cached
per row: every layer reuses it) and reads the outputs back with one more, whatever the number of
groups; causal rows need no mask, as the padding lies in every real query's future."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from odb.training.attention.explicit import allowed_keys, explicit_attention
from odb.training.attention.semantics import Pattern

# A group's padded attention area may exceed its real area (sum of L^2) by this factor.
_GROUP_SLACK = 1.3


_plan_cache: list = [None, None]


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


def _attend(q, k, v, valid: torch.Tensor | None, scaling: float | None, pattern: Pattern,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """One group: ``q, k, v [G, H(kv), L, D]``, ``valid [G, L]`` (None: no padding) -> ``[G, H, L, D]``."""
    allowed = allowed_keys(valid, q.shape[2], pattern, q.device)
    if pattern.softcap is not None or sinks is not None:
        return explicit_attention(q, k, v, allowed, scaling, pattern, sinks)
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


def grouped_varlen(q, k, v, cu_seqlens: torch.Tensor, scaling: float | None, pattern: Pattern,
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
