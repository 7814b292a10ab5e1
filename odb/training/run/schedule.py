"""Learning rate by progress: the number of optimizer steps is not known up front (it depends on
how samples pack), so warmup and decay follow the samples trained over the planned total.

The planned total counts only what will train: records that are skipped or dropped over the cap
never train, and are known only once processed. :func:`planned_to_train` estimates the total from
the share of processed records lost so far (exact once every record has been processed), from
run-wide counts that every rank has, so every rank sets the same learning rate."""

from __future__ import annotations

import math

__all__ = ["DECAYS", "ProgressSchedule", "planned_to_train"]

DECAYS = ("cosine", "linear", "constant")
"""The shapes after warmup: cosine to ``min_ratio * lr`` (odb's own), linear to it, or none."""


class ProgressSchedule:
    """Linear warmup over ``warmup_ratio`` of the planned samples, then (``decay``) cosine, by
    default, or linear to ``min_ratio * lr``, or constant.

    Args:
        lr: peak learning rate.
        total_samples: samples the run plans to train (epochs x dataset size, or the quota).
    """

    def __init__(self, lr: float, total_samples: int, *, warmup_ratio: float = 0.03,
                 min_ratio: float = 0.1, decay: str = "cosine") -> None:
        if total_samples < 1:
            raise ValueError("the schedule needs at least one planned sample")
        if decay not in DECAYS:
            raise ValueError(f"the learning rate decays by one of {DECAYS}, got {decay!r}")
        self.lr, self.total = lr, total_samples
        self.warmup_ratio, self.min_ratio, self.decay = warmup_ratio, min_ratio, decay

    def __call__(self, samples_done: int, total: int | None = None) -> float:
        """The learning rate after ``samples_done`` of ``total`` (default: the planned total)."""
        progress = min(1.0, samples_done / max(1, total or self.total))
        if self.warmup_ratio and progress < self.warmup_ratio:
            return self.lr * max(progress / self.warmup_ratio, 1e-3)
        if self.decay == "constant":
            return self.lr
        span = max(1e-12, 1.0 - self.warmup_ratio)
        if self.decay == "linear":
            shape = 1.0 - (progress - self.warmup_ratio) / span
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * (progress - self.warmup_ratio) / span))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * shape)


def planned_to_train(planned: int, *, fetched: int, lost: int) -> int:
    """Of ``planned`` sample visits (epochs x records), those expected to train, given that
    ``lost`` of the ``fetched`` records processed so far were skipped or dropped."""
    if not fetched or not lost:
        return planned
    return max(1, planned - round(planned * lost / fetched))
