"""Learning rate by progress: the number of optimizer steps is not known up front (it depends on
how samples pack), so warmup and decay follow the samples trained over the planned total."""

from __future__ import annotations

import math

__all__ = ["ProgressSchedule"]


class ProgressSchedule:
    """Linear warmup over ``warmup_ratio`` of the planned samples, then cosine to ``min_ratio * lr``.

    Args:
        lr: peak learning rate.
        total_samples: samples the run plans to train (epochs x dataset size, or the quota).
    """

    def __init__(self, lr: float, total_samples: int, *, warmup_ratio: float = 0.03,
                 min_ratio: float = 0.1) -> None:
        if total_samples < 1:
            raise ValueError("the schedule needs at least one planned sample")
        self.lr, self.total = lr, total_samples
        self.warmup_ratio, self.min_ratio = warmup_ratio, min_ratio

    def __call__(self, samples_done: int) -> float:
        progress = min(1.0, samples_done / self.total)
        if self.warmup_ratio and progress < self.warmup_ratio:
            return self.lr * max(progress / self.warmup_ratio, 1e-3)
        span = max(1e-12, 1.0 - self.warmup_ratio)
        cosine = 0.5 * (1.0 + math.cos(math.pi * (progress - self.warmup_ratio) / span))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * cosine)
