"""Exact validation loss over packed micro-batches, with odb's alignment.

The number, with ranks r, micro-batches m and label tokens t (next-token cross entropy ``l``,
shifted inside each sample, labels of -100 ignored)::

    eval_loss = sum_{r,m,t} l_{r,m,t} / N        N = sum_{r,m} label tokens of micro-batch m on rank r

One division, after the sum over every rank: every label token of the eval set weighs the same,
however the samples fell into micro-batches and onto ranks (a mean of per-batch means would not).
Each sample is scored in exactly one micro-batch of one rank: a fresh
:class:`~odb.batching.batcher.OnlineBatcher` over the eval dataset, join mode, one epoch (I2).

Alignment (I1): the eval batcher runs with ``gas = 1`` (a step is one micro-batch; nothing to
accumulate, so no dummies for that) and gives every rank the same number of steps; a rank with no
samples left runs dummy forwards. So every rank runs the same number of forwards and ZeRO-3's
parameter gathers never wait for a rank that is not coming. Forwards only, under
``torch.no_grad()``, with the model in eval mode (:meth:`OdbEngine.eval_step`).

Cross-rank sum: one ``all_gather`` of a small int64 vector after the last round, through the eval
batcher's :class:`~odb.batching.align.Aligner` (the door of every odb collective); the float64 loss
sum and wall time travel bit-cast to int64. Every rank adds the same gathered loss sums with
``math.fsum`` (exactly rounded), so every rank computes the identical float and returns the
identical :class:`EvalResult`.

The eval batcher shares the training batcher's communicator: its collectives (the settings
check at construction, one per round, the final gather) happen at the same point on every rank,
between training steps, and odb's batcher keeps no global state, so the two do not meet.
:meth:`Evaluator.run` is therefore collective: every rank, at the same moment.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from odb.batching.align import Aligner, Communicator
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.data.feed import SampleFeed
from odb.data.processing import SKIP_REASONS, SampleDataset, sample_sizes
from odb.training.engine import OdbEngine

__all__ = ["EvalResult", "Evaluator", "eval_batching"]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation, the same on every rank.

    Attributes:
        loss: summed cross entropy / label tokens, over all ranks; ``nan`` if no label tokens.
        label_tokens: label tokens scored, over all ranks.
        samples: samples scored, over all ranks.
        skipped: records not scored, by reason, over all ranks: those the data layer skipped
            (:data:`~odb.data.processing.SKIP_REASONS`), and those the over-cap policy 'drop'
            dropped, under ``over_cap``. ``samples + sum(skipped.values())`` is the dataset size.
        seconds: wall time of the evaluation (the slowest rank).
    """

    loss: float
    label_tokens: int
    samples: int
    skipped: dict[str, int]
    seconds: float


def eval_batching(batching: OdbConfig) -> OdbConfig:
    """The training settings as evaluation runs them: one micro-batch per step, join mode (every
    sample once, also where training runs to a quota); caps, policy, window and sharding kept."""
    return dataclasses.replace(batching, gas=1, mode="join", quota=None)


class Evaluator:
    """Exact eval loss over ``dataset`` (see the module docstring).

    Args:
        engine: the training engine (its backend runs the forwards).
        dataset: the eval samples, processed as for training (e.g. truncated to ``max_tokens``).
        batching: the training batcher's settings (:func:`eval_batching` adapts them).
        comm: the training batcher's communicator (or any over the same ranks).
        num_workers / prefetch_factor: the eval feed's DataLoader; its workers live for one
            :meth:`run`.
    """

    def __init__(self, engine: OdbEngine, dataset: SampleDataset, batching: OdbConfig, comm: Communicator, *,
                 num_workers: int = 0, prefetch_factor: int = 2) -> None:
        self.engine, self.dataset, self.comm = engine, dataset, comm
        self.batching = eval_batching(batching)
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor

    def run(self) -> EvalResult:
        """Scores every eval sample once (collective: every rank, at the same moment).

        The model is in eval mode during the run and back in the mode it was in after it, also
        on error; the feed's workers are stopped either way.
        """
        start = time.perf_counter()
        # The mode it found (odb trains in train mode; a caller may evaluate a model in eval mode)
        was_training = self.engine.backend.module.training
        feed = SampleFeed(self.dataset, sample_sizes, num_workers=self.num_workers,
                          prefetch_factor=self.prefetch_factor)
        loss_sum, label_tokens, samples = 0.0, 0, 0  # this rank's
        try:
            batcher = OnlineBatcher(self.batching, self.comm, dataset_size=len(self.dataset), feed=feed)
            self.engine.backend.train(False)
            for plan in batcher:
                taken = [[feed.take(uid) for uid in micro.uids] for micro in plan.micro_batches]
                step_loss, step_tokens = self.engine.eval_step(plan, taken)
                loss_sum += step_loss
                label_tokens += step_tokens
                samples += sum(len(micro.samples) for micro in plan.micro_batches)
            skipped = Counter(feed.skipped)
            skipped["over_cap"] += batcher.counts["dropped"]
        finally:
            self.engine.backend.train(was_training)
            # forwards without a backward leave parameters gathered (ZeRO-3's cache, FSDP2's root)
            self.engine.backend.release_cache()
            feed.close()
        return _combine(batcher.aligner, loss_sum, label_tokens, samples, skipped, time.perf_counter() - start)


def _combine(aligner: Aligner, loss_sum: float, label_tokens: int, samples: int, skipped: Counter[str],
             seconds: float) -> EvalResult:
    """The one gather: ``[loss_sum bits, label_tokens, samples, seconds bits, skipped...]``
    per rank. The float64 loss sums are added exactly rounded (``math.fsum``): the same inputs give
    the same float on every rank, whatever the order."""
    counts = [skipped.get(r, 0) for r in SKIP_REASONS]
    # A reason outside SKIP_REASONS (none today) counts as 'error': raising here, on one rank,
    # would leave the others waiting in the gather.
    counts[SKIP_REASONS.index("error")] += sum(n for r, n in skipped.items() if r not in SKIP_REASONS)
    floats = np.array([loss_sum, seconds], dtype=np.float64).view(np.int64)
    mine = np.array([floats[0], label_tokens, samples, floats[1], *counts], dtype=np.int64)
    gathered = aligner.gather_reports(mine)  # [world, 4 + len(SKIP_REASONS)]
    total = math.fsum(np.ascontiguousarray(gathered[:, 0]).view(np.float64).tolist())  # exactly rounded
    tokens = int(gathered[:, 1].sum())
    return EvalResult(
        loss=total / tokens if tokens else math.nan, label_tokens=tokens, samples=int(gathered[:, 2].sum()),
        skipped={r: int(n) for r, n in zip(SKIP_REASONS, gathered[:, 4:].sum(axis=0)) if n},
        seconds=float(np.ascontiguousarray(gathered[:, 3]).view(np.float64).max()))
