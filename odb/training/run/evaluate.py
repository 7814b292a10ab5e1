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

Samples over the cap are scored whole, so that the eval loss does not depend on ``max_tokens``
(the eval data is not truncated either, :func:`odb.training.run.datasets.build_datasets`). The packed pass
takes the samples within the caps (the eval batcher drops the others, whatever the training's
``over_cap``); each rank keeps the ones it dropped and, after the packed pass, scores each of them
alone, in a forward of its own with the engine's truncation lifted. One more gather first tells
every rank the most any rank holds, ``n``: every rank runs ``n`` such forwards, dummies where it
has fewer, longest first. The chunked loss runs its fixed number of chunks per forward
(:func:`odb.training.step.loss.num_loss_chunks`), bigger ones for a longer sample, so every rank still
makes the same calls. A forward without gradients keeps no activations for a backward, so a
sample a few times ``max_tokens`` long fits where a training step does; one far longer may not.

No label token in the whole set (every record skipped, or none with an assistant turn): the loss is
undefined, ``None`` (``null`` in metrics.jsonl and summary.json), never NaN.

An eval set of several sources (a data mixture) also gets each source's loss, the same sum over
that source's label tokens only::

    eval_loss/<s> = sum_{r,m,t : src(t) = s} l_{r,m,t} / N_s     N_s = label tokens of source s

from the same forwards (:class:`odb.training.step.sources.SourceSplit` splits a packed row's token losses at
its samples' bounds), the per-source sums riding on the same final gather.

Cross-rank sum: one ``all_gather`` of a small int64 vector after the last round, through the eval
batcher's :class:`~odb.batching.align.Aligner` (the door of every odb collective); the float64 loss
sums (the whole set's and, several sources, each source's) and wall time travel bit-cast to
int64. Every rank adds the same gathered loss sums with ``math.fsum`` (exactly rounded), so every
rank computes the identical float and returns the identical :class:`EvalResult`.

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
from odb.batching.cost import SampleCost
from odb.batching.feed import Sizes
from odb.batching.plan import MicroBatch, StepPlan
from odb.data.feed import SampleFeed
from odb.data.formats import SKIP_REASONS
from odb.data.processing import SampleDataset, sample_sizes
from odb.training.step.engine import OdbEngine
from odb.training.step.objective import Objective
from odb.training.step.preference import Preference
from odb.training.step.sources import SourceSums

__all__ = ["EvalResult", "Evaluator", "eval_batching"]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation, the same on every rank.

    Attributes:
        loss: summed cross entropy / label tokens, over all ranks; ``None`` if there are no label
            tokens (the loss of nothing is undefined).
        label_tokens: label tokens scored, over all ranks.
        samples: samples scored, over all ranks (those over the cap included).
        skipped: records not scored, by reason, over all ranks: those the data layer skipped
            (:data:`~odb.data.formats.SKIP_REASONS`). ``samples + sum(skipped.values())`` is the
            dataset size.
        seconds: wall time of the evaluation (the slowest rank).
        over_cap: of ``samples``, those over ``max_tokens`` (or ``max_patches``), each scored whole
            in a forward of its own.
        sources: an eval set of several sources: per source name ``(loss, label_tokens)`` of that
            source's samples alone (loss ``None`` without label tokens); empty for one source.
    """

    loss: float | None
    label_tokens: int
    samples: int
    skipped: dict[str, int]
    seconds: float
    over_cap: int = 0
    sources: dict[str, tuple[float | None, int]] = dataclasses.field(default_factory=dict)
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    """A preference objective: the means over the eval pairs of the chosen and rejected rewards,
    their margin and the share of pairs whose chosen reward is the higher (``eval_rewards/...``,
    TRL's names; then ``loss`` is per pair and ``label_tokens`` counts pairs); empty otherwise."""

    @property
    def unit(self) -> str:
        """What ``label_tokens`` counts, for the log line."""
        return "pairs" if self.rewards else "label tokens"


def eval_batching(batching: OdbConfig) -> OdbConfig:
    """The training settings as the packed pass runs them: one micro-batch per step, join mode
    (every sample once, also where training runs to a quota), samples over the caps left out (they
    are scored whole after it); caps, policy, window and sharding kept."""
    return dataclasses.replace(batching, gas=1, mode="join", quota=None, over_cap="drop")


class _KeepOverCap:
    """The eval feed as the batcher sees it (:class:`~odb.batching.batcher.Feed`), except that the
    samples the batcher drops over the caps are kept here, to be scored whole, instead of freed."""

    def __init__(self, feed: SampleFeed) -> None:
        self.feed = feed
        self.sizes: dict[int, Sizes] = {}  # fetched, not skipped
        self.over_cap: list[SampleCost] = []

    def deal(self, uids: list[int]) -> None:
        self.feed.deal(uids)

    def fetch(self, uids: list[int]) -> list[Sizes | None]:
        raw = self.feed.fetch(uids)
        self.sizes.update((uid, sizes) for uid, sizes in zip(uids, raw) if sizes is not None)
        return raw

    def forget(self, uids: list[int]) -> None:
        kept = [uid for uid in uids if uid in self.sizes]  # fetched and not admitted: over a cap
        for uid in kept:
            sizes = self.sizes[uid]
            self.over_cap.append(SampleCost(uid, sizes.tokens, sizes.label_tokens, sizes.patches, sizes.tokens,
                                            sizes.second))
        self.feed.forget([uid for uid in uids if uid not in self.sizes])


class Evaluator:
    """Exact eval loss over ``dataset`` (see the module docstring).

    Args:
        engine: the training engine (its backend runs the forwards).
        dataset: the eval samples, processed as for training but whole (not truncated to
            ``max_tokens``; a truncated one is scored as it was cut).
        batching: the training batcher's settings (:func:`eval_batching` adapts them).
        comm: the training batcher's communicator (or any over the same ranks).
        num_workers / prefetch_factor: the eval feed's DataLoader; its workers live for one
            :meth:`run`.
        objective: what each step scores (:meth:`OdbEngine.eval_step`), None: the engine's own.
        score_over_cap: score the samples over the caps whole after the packed pass (an eval set);
            False: the packed pass applies the training's over-cap policy and leaves out what
            training leaves out (the reference pass over the training data,
            :mod:`odb.training.run.reference`).
    """

    def __init__(self, engine: OdbEngine, dataset: SampleDataset, batching: OdbConfig, comm: Communicator, *,
                 num_workers: int = 0, prefetch_factor: int = 2, objective: Objective | None = None,
                 score_over_cap: bool = True) -> None:
        self.engine, self.dataset, self.comm = engine, dataset, comm
        self.batching = eval_batching(batching) if score_over_cap else \
            dataclasses.replace(batching, gas=1, mode="join", quota=None)
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.objective, self.score_over_cap = objective, score_over_cap

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
        names = tuple(self.dataset.source_names)
        by_source = SourceSums(self.engine.device) if len(names) > 1 else None
        kept = _KeepOverCap(feed)
        preference = self.objective is None and isinstance(self.engine.objective, Preference)
        rewards = [0.0, 0.0, 0.0] if preference else None  # (the run's own objective's)
        extra = {} if rewards is None else {"rewards": rewards}
        try:
            batcher = OnlineBatcher(self.batching, self.comm, dataset_size=len(self.dataset),
                                    feed=kept if self.score_over_cap else feed)
            self.engine.backend.train(False)
            for plan in batcher:
                taken = [[feed.take(uid) for uid in micro.uids] for micro in plan.micro_batches]
                step_loss, step_tokens = self.engine.eval_step(plan, taken, by_source=by_source,
                                                               objective=self.objective, **extra)
                loss_sum += step_loss
                label_tokens += step_tokens
                samples += sum(len(micro.samples) for micro in plan.micro_batches)
            whole_loss, whole_tokens = self._score_whole(batcher.aligner, kept.over_cap, feed, by_source, extra)
            loss_sum, label_tokens = loss_sum + whole_loss, label_tokens + whole_tokens
            samples += len(kept.over_cap)
        finally:
            self.engine.backend.train(was_training)
            # forwards without a backward leave parameters gathered (ZeRO-3's cache, FSDP2's root)
            self.engine.backend.release_cache()
            feed.close()
        return _combine(batcher.aligner, loss_sum, label_tokens, samples, Counter(feed.skipped),
                        len(kept.over_cap), time.perf_counter() - start,
                        sources=None if by_source is None else (names, by_source), rewards=rewards)

    def _score_whole(self, aligner: Aligner, over_cap: list[SampleCost], feed: SampleFeed,
                     by_source: SourceSums | None = None, extra: dict | None = None) -> tuple[float, int]:
        """This rank's samples over the caps, each whole in a forward of its own, longest first;
        as many forwards on every rank (dummies where it has fewer): ``(loss_sum, label_tokens)``.
        One gather (collective) of how many each rank holds."""
        most = int(aligner.gather_reports(np.array([len(over_cap)], dtype=np.int64))[:, 0].max())
        loss_sum, label_tokens = 0.0, 0
        order = sorted(over_cap, key=lambda s: (-s.tokens, s.uid))
        for i in range(most):
            micro = MicroBatch((order[i],)) if i < len(order) else MicroBatch(())
            plan = StepPlan(epoch=0, step=i, micro_batches=(micro,), num_label_tokens=0, num_samples=0,
                            rank_costs=(), rank_tokens=())  # eval_step reads only the micro-batches
            step_loss, step_tokens = self.engine.eval_step(plan, [[feed.take(s.uid) for s in micro.samples]],
                                                           truncate=False, by_source=by_source,
                                                           objective=self.objective, **(extra or {}))
            loss_sum += step_loss
            label_tokens += step_tokens
        return loss_sum, label_tokens


def _combine(aligner: Aligner, loss_sum: float, label_tokens: int, samples: int, skipped: Counter[str],
             over_cap: int, seconds: float, *, sources: tuple[tuple[str, ...], SourceSums] | None = None,
             rewards: list[float] | None = None) -> EvalResult:
    """The one gather: ``[loss_sum bits, label_tokens, samples, seconds bits, over_cap, skipped...]``
    per rank, then with ``sources`` (the names and this rank's sums, several sources) each source's
    loss sum bits and label tokens. The float64 loss sums are added exactly rounded (``math.fsum``):
    the same inputs give the same float on every rank, whatever the order."""
    counts = [skipped.get(r, 0) for r in SKIP_REASONS]
    # A reason outside SKIP_REASONS (none today) counts as 'error': raising here, on one rank,
    # would leave the others waiting in the gather.
    counts[SKIP_REASONS.index("error")] += sum(n for r, n in skipped.items() if r not in SKIP_REASONS)
    floats = np.array([loss_sum, seconds], dtype=np.float64).view(np.int64)
    head = [floats[0], label_tokens, samples, floats[1], over_cap, *counts]
    names: tuple[str, ...] = ()
    if sources is not None:
        names, sums = sources
        source_loss, source_tokens, _ = sums.read()  # (per source id: the eval dataset's own, < len(names))
        missing = len(names) - len(source_tokens)
        head += [*np.array(source_loss + [0.0] * missing, dtype=np.float64).view(np.int64),
                 *source_tokens, *[0] * missing]
    if rewards is not None:  # (last: chosen, rejected reward sums' bits, pairs ranked right)
        head += [*np.array(rewards[:2], dtype=np.float64).view(np.int64), round(rewards[2])]
    gathered = aligner.gather_reports(np.array(head, dtype=np.int64))  # [world, 5 + len(SKIP_REASONS) + 2 S (+ 3)]
    total = math.fsum(np.ascontiguousarray(gathered[:, 0]).view(np.float64).tolist())  # exactly rounded
    tokens = int(gathered[:, 1].sum())
    at, size = 5 + len(SKIP_REASONS), len(names)
    by_source = {}
    for s, name in enumerate(names):
        source_total = math.fsum(np.ascontiguousarray(gathered[:, at + s]).view(np.float64).tolist())
        source_tokens_s = int(gathered[:, at + size + s].sum())
        by_source[name] = (source_total / source_tokens_s if source_tokens_s else None, source_tokens_s)
    pair_metrics = {}
    if rewards is not None and tokens:  # (tokens: the pairs scored)
        chosen, rejected = (math.fsum(np.ascontiguousarray(gathered[:, c]).view(np.float64).tolist()) / tokens
                            for c in (-3, -2))
        pair_metrics = {"chosen": chosen, "rejected": rejected, "margins": chosen - rejected,
                        "accuracies": int(gathered[:, -1].sum()) / tokens}
    return EvalResult(
        rewards=pair_metrics,
        loss=total / tokens if tokens else None, label_tokens=tokens, samples=int(gathered[:, 2].sum()),
        skipped={r: int(n) for r, n in zip(SKIP_REASONS, gathered[:, 5:at].sum(axis=0)) if n},
        seconds=float(np.ascontiguousarray(gathered[:, 3]).view(np.float64).max()),
        over_cap=int(gathered[:, 4].sum()), sources=by_source)
