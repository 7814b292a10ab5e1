"""A Bradley-Terry reward model over packed pairs (``--objective reward``).

The model is the language model under a one-output score head
(``AutoModelForSequenceClassification``, ``num_labels`` 1:
:func:`odb.training.model.build.build_model` with ``score_head``). A sequence's reward ``r`` is
the head's output where the family's own class pools a sequence alone, its last token that is not
the pad token (:func:`pooled_at`: the one before a final end-of-sequence token where the tokenizer
pads with it, as TRL's reward models and the exported model score it); the loss of pair p
(chosen c, rejected r) is TRL ``RewardTrainer``'s::

    reward    -log sigmoid(r_c - r_r - m) + c * (r_c + r_r)^2

``m`` the record's ``margin`` (TRL's column of that name; 0 where it has none), ``c`` the
centering coefficient (``--center_rewards_coefficient``, TRL's own field of that name; 0 by
default: no centering term). TRL adds ``c * mean_p (r_c + r_r)^2`` to the batch's mean loss,
the mean of the same per-pair term: so the step's mean over its pairs is TRL's on the same pairs.

Packed, the head runs on every token of the row and each segment's pooled token is read
(:func:`sequence_scores`: a forward hook on the head, since the class itself would pool one token
of the whole row); padded (policy fixed), each row's. The loss math is the
preference objectives' (:mod:`odb.training.step.preference`): the step trains the mean over its
pairs on all ranks, each micro-batch backs ``sum_p loss_p * W / P_s``; a step reports the summed
rewards of the chosen and the rejected answers and the pairs ranked right
(``rewards/accuracies``). Labels play no part (the sequences are scored, not their tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from odb.batching.plan import MicroBatch, Shared
from odb.data.collate import collate_packed, collate_padded, to_device
from odb.data.preference import pair_sequences
from odb.training.step.preference import Preference

if TYPE_CHECKING:
    from odb.training.step.engine import OdbEngine

__all__ = ["Reward", "pooled_at", "sequence_scores"]


@dataclass(frozen=True)
class Reward(Preference):
    """The reward model's objective (the module docstring)."""

    loss: str = "reward"
    reference: str = "none"
    center: float = 0.0
    """The centering coefficient ``c`` (the module docstring)."""

    def __post_init__(self) -> None:
        if (self.loss, self.reference) != ("reward", "none"):
            raise ValueError(f"a reward model trains loss 'reward' without a reference, not {self.loss!r} against "
                             f"{self.reference!r}")
        if not self.center >= 0:
            raise ValueError(f"the centering coefficient must be >= 0, got {self.center}")

    def pairs(self, engine: OdbEngine, micro: MicroBatch, samples: Sequence[dict[str, Any]], *, truncate: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' losses ``[P]`` and rewards ``[P, 2]`` (chosen, rejected; detached): one model call."""
        seqs = [seq for sample in samples for seq in pair_sequences(sample)]
        scores = sequence_scores(engine, seqs, micro.padded, truncate=truncate).view(-1, 2)
        margins = torch.tensor([sample.get("margin", 0.0) for sample in samples], device=scores.device)
        losses = -F.logsigmoid(scores[:, 0] - scores[:, 1] - margins)
        if self.center:
            losses = losses + self.center * scores.sum(1) ** 2
        return losses, scores.detach()

    def logps(self, engine: OdbEngine, micro: MicroBatch, samples: Sequence[dict[str, Any]], *, truncate: bool = True
              ) -> torch.Tensor:
        raise TypeError("a reward model scores sequences; it has no log-probabilities (and no reference)")

    def probe_loss(self, engine: OdbEngine, samples: Sequence[dict[str, Any]], shared: Shared | None
                   ) -> torch.Tensor:
        assert shared is None, "a pair trains whole on one rank"
        return sequence_scores(engine, samples, padded=False, truncate=False).sum() * 0.0


def sequence_scores(engine: OdbEngine, seqs: Sequence[dict[str, Any]], padded: bool, *, truncate: bool = True
                    ) -> torch.Tensor:
    """Each sequence's reward ``[n]`` (fp32, with its gradient where they are on) in one model
    call, packed or, with ``padded`` (or a model odb trains padded), in padded rows: the score
    head's output where the family's own class pools the sequence alone (cut to ``max_tokens``
    unless ``truncate`` is False): its last token that is not the model's ``pad_token_id``
    (:func:`pooled_at`); where the model has none, the tokenizer's (``engine.pad_token_id``) becomes
    it, as TRL sets it and as the export saves it (a host's model keeps its own)."""
    cap = engine.max_tokens if truncate else None
    if padded or not engine.packed:
        batch = collate_padded(seqs, pad_token_id=engine.pad_token_id, max_tokens=cap)
    else:
        batch = collate_packed(seqs, max_tokens=cap)
    config = engine.model.config
    if config.pad_token_id is None:  # (the class pools a padded row by it; TRL sets it so)
        config.pad_token_id = engine.pad_token_id
    at = pooled_at(batch, config.pad_token_id)
    batch = to_device(batch, engine.device)
    del batch["labels"]
    with _head_output(engine.model.score) as output:
        engine.call(batch)
    per_token = output[0][..., 0].float()  # [B, T]
    return per_token[at[0].to(per_token.device), at[1].to(per_token.device)]


def pooled_at(batch: dict[str, Any], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sequence of a collated ``batch`` (packed: its segments; padded: its rows) is
    scored, as rows and positions: its last token that is not ``pad_token_id``, as
    ``...ForSequenceClassification`` pools a sequence (its last token where every one is). A
    tokenizer whose pad token is its end-of-sequence token (odb's default where it has none:
    Llama 3, Mistral) ends each chat sequence in it, so the token scored is the one before."""
    ids = batch["input_ids"]
    if "cu_seq_lens_q" in batch:
        bounds = batch["cu_seq_lens_q"].tolist()
        spans = [(0, a, b) for a, b in zip(bounds, bounds[1:])]
    else:
        spans = [(row, 0, int(n)) for row, n in enumerate(batch["attention_mask"].sum(1).tolist())]
    rows, positions = [], []
    for row, start, end in spans:
        real = (ids[row, start:end] != pad_token_id).nonzero()
        rows.append(row)
        positions.append(start + int(real[-1]) if len(real) else start)  # (all pad: the class's argmax, 0)
    return torch.tensor(rows), torch.tensor(positions)


@contextlib.contextmanager
def _head_output(head: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The outputs of ``head``'s forward calls while inside (under PEFT the trained copy's: its
    wrapper's output), in a list."""
    outputs: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()
