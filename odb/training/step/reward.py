"""A Bradley-Terry reward model over packed pairs (``--objective reward``).

The model is the language model under a one-output score head
(``AutoModelForSequenceClassification``, ``num_labels`` 1:
:func:`odb.training.model.build.build_model` with ``score_head``). A sequence's reward ``r`` is
the head's output at its last token, as the family's own class pools a sequence alone (its last
token that is not padding); the loss of pair p (chosen c, rejected r) is TRL ``RewardTrainer``'s::

    reward    -log sigmoid(r_c - r_r) + c * (r_c + r_r)^2

``c`` the centering coefficient (``--center_rewards_coefficient``, TRL's own field of that name;
0 by default: no centering term). TRL adds ``c * mean_p (r_c + r_r)^2`` to the batch's mean loss,
the mean of the same per-pair term: so the step's mean over its pairs is TRL's on the same pairs.

Packed, the head runs on every token of the row and each segment's last token is read
(:func:`sequence_scores`: a forward hook on the head, since the class itself would pool the row's
last token only); padded (policy fixed), each row's last real token. The loss math is the
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

__all__ = ["Reward", "sequence_scores"]


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
        losses = -F.logsigmoid(scores[:, 0] - scores[:, 1])
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
    call: the score head's output at the sequence's last token (cut to ``max_tokens`` unless
    ``truncate`` is False), packed or, with ``padded`` (or a model odb trains padded), each row's
    last real token."""
    cap = engine.max_tokens if truncate else None
    if padded or not engine.packed:
        batch = collate_padded(seqs, pad_token_id=engine.pad_token_id, max_tokens=cap)
    else:
        batch = collate_packed(seqs, max_tokens=cap)
    batch = to_device(batch, engine.device)
    del batch["labels"]
    config = engine.model.config
    if config.pad_token_id is None:  # (the class finds a padded row's last token by it)
        config.pad_token_id = engine.pad_token_id
    with _head_output(engine.model.score) as output:
        engine.call(batch)
    per_token = output[0][..., 0].float()  # [B, T]
    if "cu_seq_lens_q" in batch:
        return per_token[0, batch["cu_seq_lens_q"][1:].long() - 1]
    last = batch["attention_mask"].sum(1) - 1
    return per_token[torch.arange(len(last), device=last.device), last]


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
