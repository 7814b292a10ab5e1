"""What a rank's batcher has counted (:attr:`odb.batching.batcher.OnlineBatcher.stats`): rounds,
seconds spent waiting and planning, and the fate of every record it fetched."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatcherStats"]


@dataclass(frozen=True)
class BatcherStats:
    """What a rank's batcher has counted so far (:attr:`OnlineBatcher.stats`): this rank's, over
    the run (resumes included) unless said otherwise."""

    rounds: int
    """The run's rounds (the same on every rank)."""
    fetch_s: float
    """This process's seconds waiting for processed samples."""
    plan_s: float
    """This process's seconds in odb's own planning: packing, decisions, dealing."""
    collective_s: float
    """This process's seconds inside odb's collectives."""
    observed_samples: int
    """Samples admitted into the window."""
    skipped: int
    """Records the data workers could not make a sample of."""
    dropped: int
    """Samples over the cap dropped (``over_cap: "drop"``)."""
    truncated: int
    """Samples the cost model cut to ``max_tokens``, and the tokens it cut (``truncated_tokens``)."""
    truncated_tokens: int
    long: int = 0
    """Samples over ``max_tokens`` admitted whole, for a group of ranks to train together
    (over_cap 'sequence_parallel')."""

    @property
    def fetched(self) -> int:
        """Records processed: admitted, skipped or dropped."""
        return self.observed_samples + self.lost

    @property
    def lost(self) -> int:
        """Records processed that will never train."""
        return self.skipped + self.dropped
