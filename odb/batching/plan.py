"""Step plans and the round decision: a pure function of what every rank gathered.

One round (see :mod:`odb.batching.align` for the protocol): every rank packs its window, ranks its bins
(best first) and sends one fixed-size int64 vector, its *proposal*. After the one ``all_gather``,
every rank runs :func:`decide` on the same matrix and so reaches the same decision:

* ``T``, the micro-batch slots every rank fills this round, a multiple of GAS (I1). While some
  rank still expects input, ``T`` is the smallest number of ready bins over those ranks, rounded
  down to GAS; bins beyond it stay in the window (carry, never drop). ``T = 0`` in a round that
  deals new indices (a starved rank waits for them) and in a round where no rank holds a bin
  (every window was skipped or dropped: the ranks fetch more next round); otherwise ``T`` is at
  least GAS, so every round makes progress. When every rank's input is exhausted, ``T`` is the
  largest bin count, rounded up, and ranks with fewer bins fill with dummies: the epoch ends in
  that round (I2, I3).
* Which bin goes to which slot: each rank's bins sorted by cost, then one permutation shared by
  all ranks, so the micro-batches that meet at each ZeRO sync point cost about the same.
* ``N_step``, the label tokens of every step over all ranks, known before its first backward (I4).
* The next indices each rank receives (dynamic sharding): the ranks whose pending work is
  smallest get more, by water-filling on estimated cost; near the end of the stream part is held
  back (:func:`deal_budget`) so all ranks run out together.
* Quota mode: in the round where the quota is reached, bins are taken position-major
  round-robin over ranks and the last one is cut, so exactly ``quota`` samples are trained and
  only the last step holds dummies (given ``window >= GAS`` and no empty static shard). The cut
  bin's tokens and cost are those of the samples it keeps: in quota mode every proposal carries
  per-sample tokens and cost steps (:meth:`odb.batching.packer.Bin.cost_steps`) beside the label tokens.
  A run whose first full pass over the data admits no sample (all skipped or dropped over the
  cap) can never reach its quota: :func:`decide` raises :class:`NoSampleAdmitted` on every rank.

Bounds (I3), tested exhaustively on small instances and by property tests:

* static shards: every round consumes at least one sample of every rank that still has input
  (trains it, or fetched it and found it skipped or dropped), so an epoch ends within
  ``max(shard size) + 1`` rounds (the +1: the drain round). The ``fixed`` baseline may hold
  fetched samples short of a batch: with skipped samples its bound is ``2 * max(shard size) + 1``.
* dynamic dealing: a round trains at least one bin, deals at least one index, or fetched at least
  one index that was skipped or dropped, so an epoch of N samples ends within ``2 * N + 2``
  rounds. Measured on 16k-sample traces with 8 ranks and a 1024 window: 6-10 rounds.
* quota mode: if the first pass admits nothing, the run stops in the round that fetches the last
  index of that pass.
* dummies: a rank that still expects input gets at most ``GAS - 1`` in a round when it holds
  fewer than GAS samples, ``GAS`` when every sample it fetched was skipped or dropped; a rank whose
  input is used up gets ``T - bins`` (it joins the others' steps with zero-weight passes, as I1
  requires).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from odb.batching.cost import SampleCost

__all__ = [
    "HEADER",
    "Decision",
    "MicroBatch",
    "NoSampleAdmitted",
    "Proposal",
    "StepPlan",
    "deal_budget",
    "decide",
    "waterfill",
]

# Proposal header fields, then per-bin cost / samples / tokens, then per-sample label tokens (and,
# in quota mode, per-sample tokens and cost steps).
HEADER = ("is_fatal", "is_exhausted", "num_bins", "num_ready", "window_samples", "window_cost", "num_pending",
          "observed_cost", "observed_cost_sq", "observed_samples", "is_first_pass_open", "num_skipped",
          "num_dropped")


class NoSampleAdmitted(ValueError):
    """Quota mode: a full pass over the data admitted no sample, so the quota is out of reach."""


class MicroBatch(NamedTuple):
    """One forward/backward on one rank: samples packed in one row (or padded rows).

    An empty ``samples`` is a dummy: a real, tiny forward and backward with loss weight 0.
    """

    samples: tuple[SampleCost, ...]
    padded: bool = False

    @property
    def is_dummy(self) -> bool:
        return not self.samples

    @property
    def uids(self) -> list[int]:
        return [s.uid for s in self.samples]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def materialized(self) -> int:
        """Tokens the model processes, padding included."""
        if self.padded:
            return len(self.samples) * max((s.tokens for s in self.samples), default=0)
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
class Proposal:
    """What one rank sends: header values, its ranked bins, their samples' label tokens.

    ``sample_tokens`` and ``sample_costs`` (quota mode only, ``None`` otherwise) let every rank
    price a cut bin exactly: the first k cost steps of a bin sum to the cost of its first k
    samples as one bin.
    """

    is_fatal: bool  # this rank must stop (a bad sample under strict, an over-cap error): all stop
    is_exhausted: bool
    num_ready: int
    window_samples: int
    window_cost: int
    num_pending: int
    observed_cost: int
    observed_cost_sq: int
    observed_samples: int  # samples admitted over the whole run
    is_first_pass_open: bool  # indices of the run's first pass over the data still to be fetched
    num_skipped: int  # over the whole run: records the data layer skipped
    num_dropped: int  # ... and samples dropped over the cap
    bin_costs: list[int]
    bin_samples: list[int]
    bin_tokens: list[int]
    sample_labels: list[int]
    sample_tokens: list[int] | None = None
    sample_costs: list[int] | None = None

    def encode(self, max_bins: int, max_samples: int) -> np.ndarray:
        """``[header, costs, samples, tokens (max_bins each), labels (, tokens, costs) (max_samples)]``."""
        num_bins, num_samples = len(self.bin_costs), len(self.sample_labels)
        assert num_bins <= max_bins and num_samples <= max_samples, "proposal too large"
        per_sample = [self.sample_labels]
        if self.sample_tokens is not None:
            per_sample += [self.sample_tokens, self.sample_costs]
        head = len(HEADER)
        out = np.zeros(head + 3 * max_bins + len(per_sample) * max_samples, dtype=np.int64)
        out[:head] = (int(self.is_fatal), int(self.is_exhausted), num_bins, self.num_ready, self.window_samples,
                      self.window_cost, self.num_pending, self.observed_cost, self.observed_cost_sq,
                      self.observed_samples, int(self.is_first_pass_open), self.num_skipped, self.num_dropped)
        for i, values in enumerate((self.bin_costs, self.bin_samples, self.bin_tokens)):
            out[head + i * max_bins:head + i * max_bins + num_bins] = values
        base = head + 3 * max_bins
        for i, values in enumerate(per_sample):
            assert len(values) == num_samples, "one value per sample"
            out[base + i * max_samples:base + i * max_samples + num_samples] = values
        return out


@dataclass
class Decision:
    """The round's outcome, identical on every rank.

    ``slots[r][p]`` is the index (in rank r's ranked bins) of the bin at position p, or -1 for a
    dummy; ``cut`` = (rank, bin index, samples kept) when quota closure cuts one bin.
    """

    slots: list[list[int]]
    cut: tuple[int, int, int] | None
    step_label_tokens: list[int]
    step_samples: list[int]
    slot_costs: np.ndarray  # [world, T]
    slot_tokens: np.ndarray  # [world, T]
    samples_taken: list[int]
    new_indices: list[int]  # per rank, how many next stream indices it receives
    is_epoch_done: bool
    is_quota_done: bool


def waterfill(loads: list[int], unit: int, total: int, caps: list[int]) -> list[int]:
    """Deal up to ``total`` items of weight ``unit``, at most ``caps[r]`` to rank r, so that the
    largest final load is smallest.

    Same result as giving each item in turn to the least-loaded rank that has room (ties to the
    lower rank), computed in O(world * log) with integers so every rank gets the same answer.
    """
    world = len(loads)
    caps = [max(0, int(c)) for c in caps]
    loads = [int(x) for x in loads]
    total = min(int(total), sum(caps))
    if total <= 0:
        return [0] * world

    def fill(level: int) -> list[int]:
        return [min(cap, max(0, (level - load) // unit)) for load, cap in zip(loads, caps)]

    low, high = min(loads), max(loads) + unit * total
    while low < high:  # the largest level whose whole-unit fill stays within total
        mid = (low + high + 1) // 2
        if sum(fill(mid)) <= total:
            low = mid
        else:
            high = mid - 1
    counts = fill(low)
    rest = total - sum(counts)
    order = sorted((r for r in range(world) if counts[r] < caps[r]),
                   key=lambda r: (loads[r] + counts[r] * unit, r))
    for r in order[:rest]:
        counts[r] += 1
    return counts


class _Gathered(NamedTuple):
    """The gathered proposals, cut to the columns in use (``B``: the most bins any rank holds,
    ``S``: the most samples)."""

    fields: dict[str, np.ndarray]  # header field -> [world]
    costs: np.ndarray  # [world, B] per ranked bin
    samples: np.ndarray  # [world, B]
    tokens: np.ndarray  # [world, B]
    labels: np.ndarray  # [world, S] per sample, bin after bin
    sample_tokens: np.ndarray | None  # [world, S], quota mode only
    sample_costs: np.ndarray | None  # [world, S], quota mode only

    @property
    def num_bins(self) -> np.ndarray:
        return self.fields["num_bins"]


def _unpack(gathered: np.ndarray, max_bins: int, max_samples: int) -> _Gathered:
    head, base = len(HEADER), len(HEADER) + 3 * max_bins
    fields = {name: gathered[:, i] for i, name in enumerate(HEADER)}
    used_bins = int(fields["num_bins"].max())
    costs, samples, tokens = (gathered[:, head + i * max_bins:head + i * max_bins + used_bins] for i in range(3))
    used = int(samples.sum(axis=1).max()) if used_bins else 0
    num_rows = (gathered.shape[1] - base) // max_samples if max_samples else 1
    assert num_rows in (1, 3) and base + num_rows * max_samples == gathered.shape[1], "unknown proposal layout"
    rows = [gathered[:, base + i * max_samples:base + i * max_samples + used] for i in range(num_rows)]
    if num_rows == 1:
        rows += [None, None]
    return _Gathered(fields, costs, samples, tokens, *rows)


def decide(gathered: np.ndarray, *, max_bins: int, max_samples: int, gas: int, seed: int, epoch: int,
           round_index: int, quota_left: int | None, stream_left: int | None, inflight_target: int) -> Decision:
    """The round decision from the gathered proposals ``[world, len]``; see the module docstring.

    Args:
        max_bins, max_samples: the proposal layout (:meth:`Proposal.encode`).
        quota_left: samples still to train in quota mode, ``None`` in join mode.
        stream_left: indices not yet dealt (``None``: static shards, nothing to deal).
        inflight_target: samples each rank should hold or expect (window + lookahead).

    Raises:
        NoSampleAdmitted: quota mode, on every rank alike, once a full pass admitted nothing.
    """
    g = _unpack(gathered, max_bins, max_samples)
    world = gathered.shape[0]
    if quota_left is not None:
        _check_quota_reachable(g.fields, quota_left)
    deal = _Dealer(g.fields, g.costs, g.samples, stream_left, inflight_target)
    target, is_drain, new_indices = _target(g.fields, gas, deal)
    take = np.minimum(g.num_bins, target)
    cut, is_quota_done = None, False
    if quota_left is not None and target and int((g.samples * _first(take, g.samples)).sum()) >= quota_left:
        take, cut = _close_quota(g.samples, g.num_bins, quota_left)
        target = _round_up(int(take.max()), gas)
        is_quota_done, new_indices = True, [0] * world
    figures = _bin_figures(g, cut)
    slots = _slots(figures.costs, take, target)
    if target and not is_quota_done:
        slots = slots[:, np.random.default_rng([seed, epoch, round_index]).permutation(target)]
    slot_costs, slot_tokens, slot_labels, slot_samples = _at_slots(figures, slots)
    return Decision(slots=slots.tolist(), cut=cut,
                    step_label_tokens=_per_step(slot_labels, gas), step_samples=_per_step(slot_samples, gas),
                    slot_costs=slot_costs, slot_tokens=slot_tokens,
                    samples_taken=[int(x) for x in (figures.samples * _first(take, figures.samples)).sum(axis=1)],
                    new_indices=new_indices, is_epoch_done=is_drain or is_quota_done,
                    is_quota_done=is_quota_done)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _first(take: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``[world, B]`` mask of each rank's first ``take[r]`` ranked bins."""
    return np.arange(like.shape[1])[None, :] < take[:, None]


def _per_step(slot_values: np.ndarray, gas: int) -> list[int]:
    """Sums over ranks and over the GAS slots of each step (no steps: an empty list)."""
    return [int(x) for x in slot_values.sum(axis=0).reshape(-1, gas).sum(axis=1)]


def _check_quota_reachable(fields: dict[str, np.ndarray], quota_left: int) -> None:
    """Raise on every rank alike once the first pass over the data is fetched and admitted nothing."""
    if fields["observed_samples"].sum() or fields["is_first_pass_open"].any():
        return
    skipped, dropped = int(fields["num_skipped"].sum()), int(fields["num_dropped"].sum())
    raise NoSampleAdmitted(
        f"quota mode: a full pass over the data admitted no sample: {skipped} skipped (the data layer "
        f"returned None), {dropped} dropped over the cap; the {quota_left} samples left of the quota can "
        "never be trained. Fix the data or its format (e.g. records without an assistant turn), or "
        "raise --max_tokens / --max_patches or set --over_cap truncate")


def _target(fields: dict[str, np.ndarray], gas: int, deal: _Dealer) -> tuple[int, bool, list[int]]:
    """``T``, whether this is the drain round, and the indices dealt (see the module docstring)."""
    num_bins = fields["num_bins"]
    active = fields["is_exhausted"] == 0
    if not active.any():  # drain: every rank's input is used up (nothing is left to deal)
        return _round_up(int(num_bins.max()), gas), True, [0] * len(num_bins)
    target = int(fields["num_ready"][active].min()) // gas * gas
    new_indices = deal(np.minimum(num_bins, target))
    if target == 0 and not any(new_indices) and num_bins.any():
        target = gas  # nothing to wait for: train what there is, so every round makes progress
        new_indices = deal(np.minimum(num_bins, target))
    # No rank holds a bin and nothing is dealt: T = 0; every active rank fetches more next round.
    return target, False, new_indices


class _BinFigures(NamedTuple):
    """Per ranked bin ``[world, B]``, as trained this round (a cut bin: the samples it keeps)."""

    costs: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    samples: np.ndarray


def _bin_figures(g: _Gathered, cut: tuple[int, int, int] | None) -> _BinFigures:
    """Costs, tokens, label tokens and samples of each ranked bin; a cut bin's from the samples it
    keeps (its first ``keep``: per-sample figures, exact, never pro-rated)."""
    # Label tokens of each ranked bin: differences of the per-sample cumulative sums.
    world = g.samples.shape[0]
    csum = np.zeros((world, g.labels.shape[1] + 1), dtype=np.int64)
    np.cumsum(g.labels, axis=1, out=csum[:, 1:])
    ends = np.cumsum(g.samples, axis=1)
    labels = np.take_along_axis(csum, ends, 1) - np.take_along_axis(csum, ends - g.samples, 1)
    figures = _BinFigures(g.costs.copy(), g.tokens.copy(), labels, g.samples.copy())
    if cut is not None:
        assert g.sample_tokens is not None, "quota mode proposals carry per-sample tokens and costs"
        r, b, keep = cut
        start = int(ends[r, b] - g.samples[r, b])
        kept = slice(start, start + keep)
        figures.costs[r, b] = g.sample_costs[r, kept].sum()
        figures.tokens[r, b] = g.sample_tokens[r, kept].sum()
        figures.labels[r, b] = g.labels[r, kept].sum()
        figures.samples[r, b] = keep
    return figures


def _slots(bin_costs: np.ndarray, take: np.ndarray, target: int) -> np.ndarray:
    """``[world, T]``: each rank's first ``take[r]`` bins by cost (descending), then dummies (-1)."""
    world, width = len(take), int(take.max())
    taken = _first(take, bin_costs)[:, :width]
    order = np.argsort(np.where(taken, -bin_costs[:, :width], 1), axis=1, kind="stable")
    slots = np.full((world, target), -1, dtype=np.int64)
    slots[:, :width] = np.where(np.take_along_axis(taken, order, 1), order, -1)
    return slots


def _at_slots(figures: _BinFigures, slots: np.ndarray) -> list[np.ndarray]:
    """Each figure ``[world, T]`` at the slots (0 for dummies)."""
    valid = slots >= 0
    if not valid.any():  # no bins at all (possibly zero columns to index)
        return [np.zeros(slots.shape, dtype=np.int64) for _ in figures]
    safe = np.where(valid, slots, 0)
    return [np.where(valid, np.take_along_axis(values, safe, 1), 0) for values in figures]


class _Dealer:
    """Which next stream indices go to which rank, given how many bins each rank trains now.

    Ranks whose pending work (carried samples plus dealt-but-unprocessed ones at the observed
    mean cost) is smallest get more, up to ``window + lookahead`` in flight per rank.
    """

    def __init__(self, fields, costs, samples, stream_left, inflight_target) -> None:
        self.fields, self.costs, self.samples = fields, costs, samples
        self.stream_left, self.inflight_target = stream_left, inflight_target
        observed = int(fields["observed_samples"].sum())
        self.unit, self.spread = 1, 1.0
        if observed:
            mean = fields["observed_cost"].sum() / observed
            self.unit = max(1, int(mean))
            var = fields["observed_cost_sq"].sum() / observed - mean * mean
            self.spread = math.sqrt(max(0.0, var)) / mean

    def __call__(self, take: np.ndarray) -> list[int]:
        fields, world, left = self.fields, len(take), self.stream_left
        if not left:
            return [0] * world
        took = _first(take, self.costs)
        carry_cost = fields["window_cost"] - (self.costs * took).sum(axis=1)
        carry_samples = fields["window_samples"] - (self.samples * took).sum(axis=1)
        room = self.inflight_target - (carry_samples + fields["num_pending"])
        loads = carry_cost + fields["num_pending"] * self.unit
        budget = deal_budget(left, world, self.inflight_target, self.spread)
        return waterfill(loads.tolist(), self.unit, budget, room.tolist())


def deal_budget(left: int, world: int, inflight_target: int, spread: float) -> int:
    """How many of the ``left`` undealt indices may go out now.

    The cost of what is dealt is unknown until it is processed: a rank's share of D indices is
    off by about ``spread * sqrt(D / world)`` samples (``spread``: the coefficient of variation
    of sample cost). Near the end of the stream keep back three times that for every rank,
    ``3 * spread * sqrt(D * world)``, to correct it in later rounds on observed loads, so that all
    ranks run out together; at least half of what is left goes out each round, so the tail
    takes O(log) rounds.
    """
    if left <= world * inflight_target:
        return min(left, max(world, left // 2, left - int(3.0 * spread * math.sqrt(left * world))))
    return left


def _close_quota(samples: np.ndarray, num_bins: np.ndarray, quota_left: int):
    """Position-major round-robin over ranks until exactly ``quota_left`` samples; cut the last."""
    world = samples.shape[0]
    take = np.zeros(world, dtype=np.int64)
    count = 0
    for position in range(int(num_bins.max())):
        for r in range(world):
            if position >= num_bins[r]:
                continue
            n = int(samples[r, position])
            take[r] += 1
            if count + n >= quota_left:
                keep = quota_left - count
                cut = (r, position, keep) if keep < n else None
                return take, cut
            count += n
    raise AssertionError("quota closure called without enough samples")
