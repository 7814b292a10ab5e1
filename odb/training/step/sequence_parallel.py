"""Sequence parallelism: ``S`` ranks hold one packed row together (DeepSpeed's Ulysses attention).

With ``sequence_parallel_size S`` the ``W`` ranks form ``W / S`` groups of ``S`` consecutive ranks.
odb batches over the groups (:class:`odb.batching.align.SequenceGroups`): the ranks of a group run
the same plan, with a budget of ``S x max_tokens`` per micro-batch, and each rank holds ``1/S`` of
every packed row. Everything but attention is per token, so each rank runs it on its own slice;
attention needs the whole row, and DeepSpeed's ``UlyssesSPAttentionHF`` gives it: an all-to-all
turns ``[T/S tokens, all heads]`` into ``[T tokens, H/S heads]`` on each rank, odb's varlen
attention runs the model's own semantics over the whole row (each sample alone, causal, windows,
softcap, sinks), and a second all-to-all turns the result back. The position ids are gathered
with it; odb's attention finds the samples where they restart at 0.

A packed row of ``T = 7`` tokens, ``S = 2`` (padded to ``T' = 8``, a multiple of S)::

    tokens          a0   a1   a2   a3 | a4   b0   b1  pad     (pad: its own sample, labels -100)
    position ids     0    1    2    3 |  4    0    1    0
    labels        -100   a1   a2   a3 | a4 -100   b1 -100
    shifted         a1   a2   a3   a4 |-100  b1 -100 -100     (what position t predicts: label t + 1)
                    rank 0: the first T'/2 tokens | rank 1: the rest

(a3's target, a4, lies on rank 1: the shift before the cut keeps it on rank 0.)

The labels are shifted over the whole row before it is cut, so a rank's last token keeps the
label that lies on the next rank. The loss math then holds as without sequence parallelism: each
rank's micro-batch backs ``sum over its slice of l_t * W / N_s`` (``N_s``: the step's label
tokens, each counted once per group), both backends average gradients over all ``W`` ranks, and
the all-to-all's backward carries each token's gradient to the rank that computed it, so the
mean over ranks of the gradients is ``grad(sum_t l_t / N_s)`` exactly. What a step reports (its
loss, a router loss, the per-source losses) is summed over the group's ranks once per step
(:meth:`SequenceParallel.group_sum`), so the group's first rank reports the group's figures, the
row the aligner keeps.

Per micro-batch (over_cap 'sequence_parallel', :func:`setup_groups`): the ranks plan alone, and only
a sample over a rank's budget is shared, at one micro-batch position, by the smallest aligned
group of ``d`` consecutive ranks that holds it (:mod:`odb.batching.decide`); the slicing, the
labels and the loss are the same, on that group, for that micro-batch.

Scope: packed text models (a vision model's images would have to be split between ranks, and its
M-RoPE position ids are 3-D: refused, naming the fix); the head counts must divide by ``S``, or
``S`` by the KV heads (DeepSpeed replicates KV heads then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from odb.training import attention

__all__ = ["SequenceParallel", "check_model", "long_sample_degrees", "receive", "setup", "setup_groups"]


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group.

    Attributes:
        size: ranks per group (S).
        member: this rank's index in its group (0 .. S - 1): which slice of each row it holds.
        group: the torch process group of the group's ranks (the model's device backend).
        around: the attention call through the group's Ulysses all-to-all
            (:func:`odb.training.attention.varlen.route_through`).
    """

    size: int
    member: int
    group: Any
    around: Any = None

    def shard(self, batch: dict[str, Any], labels: torch.Tensor, *, pad_token_id: int,
              sources: torch.Tensor | None = None) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None,
                                                            torch.Tensor]:
        """This rank's slice of one packed row (the module docstring's example).

        Args:
            batch: :func:`odb.data.collate.collate_packed`'s model inputs (one row, text only), labels out.
            labels: ``[1, T]``.
            sources: ``[1, T]``, each token's source, or None.

        Returns:
            ``(inputs, shifted_labels, shifted_sources, real)``: the slice's ``input_ids`` and
            ``position_ids`` (the row's sample bounds and lengths are dropped: the attention finds
            them in the gathered position ids); the labels each position of the slice predicts;
            the same for the sources (or None); ``[1, T'/S]`` 1 where a token is the row's own (not
            the padding to a multiple of S).
        """
        ids, positions = batch["input_ids"], batch["position_ids"]
        if ids.shape[0] != 1 or positions.dim() != 2:
            raise ValueError(f"sequence parallelism splits one packed text row; got input_ids {tuple(ids.shape)}, "
                             f"position_ids {tuple(positions.shape)}")
        length = ids.shape[1]
        pad = -length % self.size
        shifted = torch.full((1, length + pad), -100, dtype=labels.dtype, device=labels.device)
        shifted[:, :length - 1] = labels[:, 1:]
        real = torch.zeros_like(shifted)
        real[:, :length] = 1
        if pad:
            ids = torch.cat([ids, ids.new_full((1, pad), pad_token_id)], dim=1)
            positions = torch.cat([positions, torch.arange(pad, device=positions.device)[None]], dim=1)
        if sources is not None:
            moved = torch.zeros_like(shifted)
            moved[:, :length - 1] = sources[:, 1:]
            sources = moved
        width = (length + pad) // self.size
        part = slice(self.member * width, (self.member + 1) * width)
        inputs = {"input_ids": ids[:, part], "position_ids": positions[:, part]}
        return inputs, shifted[:, part], None if sources is None else sources[:, part], real[:, part]

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the group's ranks (every rank of the group calls it, in step)."""
        import torch.distributed as dist

        summed = values.clone()
        dist.all_reduce(summed, group=self.group)
        return summed


def receive(group: SequenceParallel, owner: int, tokens: int, samples: list[dict[str, Any]], *, rank: int,
            device) -> list[dict[str, Any]]:
    """A long sample on every rank of its ``group`` (over_cap 'sequence_parallel'): its ``owner``
    sends the ids, labels and source it holds (``samples``: the sample there, empty elsewhere),
    after its length, which every rank checks against the plan's ``tokens`` (so a disagreement
    stops the whole group, naming it, instead of leaving the others waiting). Two broadcasts inside
    the group, on the model's ``device``."""
    import torch.distributed as dist

    held = torch.full((1,), -1, dtype=torch.long, device=device)
    if rank == owner and len(samples) == 1:  # (else -1: the plan and the data disagree)
        sample = samples[0]
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long).reshape(-1)
        labels = sample.get("labels")
        labels = ids if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1)
        held.fill_(len(ids) if len(labels) == len(ids) else -1)
    dist.broadcast(held, src=owner, group=group.group)
    if int(held) != tokens:
        raise RuntimeError(f"rank {owner} holds a long sample of {int(held)} tokens (-1: not one sample, or ids and "
                           f"labels of different lengths) where the plan says {tokens}: the data and the plan "
                           "disagree (data processing that is not deterministic?)")
    if rank == owner:
        row = torch.cat([ids, labels, torch.tensor([int(sample.get("source", 0))])]).to(device)
    else:
        row = torch.empty(2 * tokens + 1, dtype=torch.long, device=device)
    dist.broadcast(row, src=owner, group=group.group)
    row = row.cpu()
    return [{"input_ids": row[:tokens], "labels": row[tokens:2 * tokens], "source": int(row[-1])}]


def check_model(model, size: int) -> None:
    """Raises ``ValueError`` naming the fix where ``model`` cannot be trained at sequence-parallel
    size ``size``: a vision model, or head counts that do not divide."""
    text = model.config.get_text_config()
    if getattr(getattr(model, "model", None), "visual", None) is not None or text is not model.config:
        raise ValueError(f"sequence_parallel_size {size}: {type(model).__name__} is a vision model, whose images "
                         "odb cannot yet split between ranks; train it with sequence_parallel_size 1")
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(f"sequence_parallel_size {size} must divide the model's {heads} attention heads, and its "
                         f"{kv_heads} KV heads must divide by it or it by them (DeepSpeed's Ulysses splits heads "
                         "between the ranks of a group); choose a size that does")


def long_sample_degrees(model, max_sp: int, world_size: int) -> tuple[int, ...]:
    """over_cap 'sequence_parallel': the group sizes that may train a long sample together (the
    powers of two up to ``max_sp`` that divide ``world_size``); raises ``ValueError`` naming the
    fix where ``model`` cannot be trained at one of them (:func:`check_model`)."""
    from odb.batching.cost import sequence_parallel_degrees

    degrees = sequence_parallel_degrees(max_sp, world_size)
    for d in degrees:
        try:
            check_model(model, d)
        except ValueError as err:
            raise ValueError(f"--over_cap sequence_parallel with --max_sp {max_sp} on {world_size} ranks forms groups "
                             f"of {', '.join(map(str, degrees))} ranks: {err} (a lower --max_sp, or --over_cap "
                             "truncate)") from None
    return degrees


def setup(model, size: int, *, rank: int, world_size: int) -> SequenceParallel:
    """Forms the groups of ``size`` consecutive ranks (collective: every rank, once) and routes
    odb's attention through DeepSpeed's Ulysses all-to-all over this rank's group
    (:mod:`odb.training.backends.ulysses`)."""
    if world_size % size:
        raise ValueError(f"sequence_parallel_size {size} must divide the {world_size} ranks")
    group = _group(model, size, rank=rank, world_size=world_size)
    attention.route_through(group.around)
    return group


def setup_groups(model, degrees: tuple[int, ...], *, rank: int, world_size: int) -> dict[int, SequenceParallel]:
    """over_cap 'sequence_parallel': for each group size ``d`` of ``degrees``, the groups of ``d``
    consecutive ranks (collective: every rank, once, in the same order), each with its own Ulysses
    attention. Attention routes through one only while a micro-batch of that size runs
    (:meth:`odb.training.step.engine.OdbEngine.train_step`)."""
    return {d: _group(model, d, rank=rank, world_size=world_size) for d in degrees}


def _group(model, size: int, *, rank: int, world_size: int) -> SequenceParallel:
    from odb.training.backends.ulysses import ulysses_attention

    check_model(model, size)
    text = model.config.get_text_config()
    ulysses, group = ulysses_attention(attention.varlen_attention, text, size, rank=rank, world_size=world_size)
    heads = slice(rank % size * text.num_attention_heads // size, (rank % size + 1) * text.num_attention_heads // size)

    def around(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None:
            raise ValueError("sequence parallelism trains packed rows only (no attention_mask)")
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            if kwargs.get(name) is not None:  # (the whole row's bounds come from the gathered position ids)
                raise ValueError(f"sequence parallelism derives the row's samples from position_ids, got {name}")
        if kwargs.get("s_aux") is not None:  # gpt-oss's sinks, one per head: this rank attends with heads[member]
            kwargs["s_aux"] = kwargs["s_aux"][heads]
        return ulysses(module, query, key, value, None, **kwargs)

    return SequenceParallel(size=size, member=rank % size, group=group, around=around)
