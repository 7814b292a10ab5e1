"""What a round decides and a rank trains: step plans, micro-batches, the decision itself.

A :class:`StepPlan` is one optimizer step on one rank: GAS :class:`MicroBatch` es (dummies
included) and the step's global label tokens N_step. :class:`Decision` is a round's outcome, the
same on every rank (made by :func:`odb.batching.decide.decide`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from odb.batching.cost import SampleCost

__all__ = ["Decision", "MicroBatch", "NoSampleAdmitted", "Shared", "StepPlan"]


class NoSampleAdmitted(ValueError):
    """Quota mode: a full pass over the data admitted no sample, so the quota is out of reach."""


class Shared(NamedTuple):
    """A micro-batch that a group of ranks trains together (over_cap 'sequence_parallel'): one
    long sample, held by ``owner``, each rank of the group training its slice."""

    owner: int  # the rank that fetched the sample (it sends it to the others)
    degree: int  # ranks in the group: ``owner // degree * degree`` and the next ``degree - 1``
    tokens: int  # the sample's tokens, all slices together


class MicroBatch(NamedTuple):
    """One forward/backward on one rank: samples packed in one row (or padded rows).

    An empty ``samples`` is a dummy: a real, tiny forward and backward with loss weight 0; unless
    ``shared`` says it is this rank's slice of another rank's long sample (its owner's
    micro-batch holds the sample, and says ``shared`` too).
    """

    samples: tuple[SampleCost, ...]
    padded: bool = False
    shared: Shared | None = None

    @property
    def is_dummy(self) -> bool:
        return not self.samples and self.shared is None

    @property
    def uids(self) -> list[int]:
        return [s.uid for s in self.samples]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def rows(self) -> int:
        """Rows of a padded micro-batch: one a sequence (a pair is two, :class:`SampleCost`)."""
        return sum(s.rows for s in self.samples)

    @property
    def materialized(self) -> int:
        """Tokens the model processes, padding included: padded, every row (a pair: two) as long
        as the longest sequence."""
        if self.padded:
            return self.rows * max((s.longest for s in self.samples), default=0)
        return self.tokens

    @property
    def label_tokens(self) -> int:
        return sum(s.label_tokens for s in self.samples)


class StepPlan(NamedTuple):
    """One optimizer step on one rank: GAS micro-batches and the step's global label tokens.

    ``num_label_tokens`` (N_step) and ``num_samples`` count the whole step over all ranks.
    ``rank_costs[m][r]`` is the cost of micro-batch ``m`` on rank ``r`` and ``rank_tokens`` its
    real tokens (every rank knows all of them from the round's one collective).
    """

    epoch: int
    step: int
    micro_batches: tuple[MicroBatch, ...]
    num_label_tokens: int
    num_samples: int
    rank_costs: tuple[tuple[int, ...], ...]
    rank_tokens: tuple[tuple[int, ...], ...]


@dataclass
class Decision:
    """The round's outcome, identical on every rank.

    ``slots[r][p]`` is the index (in rank r's ranked bins) of the bin at position p, or -1 for a
    dummy; ``cut`` = (rank, bin index, samples kept) when quota closure cuts one bin.
    """

    slots: np.ndarray  # [world, T]
    cut: tuple[int, int, int] | None
    step_label_tokens: list[int]
    step_samples: list[int]
    slot_costs: np.ndarray  # [world, T]
    slot_tokens: np.ndarray  # [world, T]
    samples_taken: list[int]
    new_indices: list[int]  # per rank, how many next stream indices it receives
    is_epoch_done: bool
    is_quota_done: bool
    shared: np.ndarray | None = None
    """``[world, T]``: at a position where a group of ranks trains a long sample, its owner's rank
    on every rank of the group (the owner's slot is the sample's bin); -1 elsewhere. None: no long
    sample this round."""
