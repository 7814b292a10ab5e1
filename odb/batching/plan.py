"""Step plans and the round decision: a pure function of what every rank gathered.

One round (see :mod:`odb.batching.align` for the protocol): every rank packs its window, orders
its bins (the ones to train first first) and sends one fixed-size int64 vector, its *proposal*
(:func:`odb.batching.wire.proposal_layout`). After the one ``all_gather`` every rank runs
:func:`decide` on the same decoded vectors, and so reaches the same decision, in five phases
(one function each, in this order):

1. ``T`` (``_target``): the micro-batch slots every rank fills this round, a multiple of GAS
   (I1). While some rank still expects input, ``T`` is the smallest number of ready bins over
   those ranks, rounded down to GAS; bins beyond it stay in the window (carry, never drop).
   ``T = 0`` in a round that deals new indices (a starved rank waits for them) and in a round
   where no rank holds a bin (every window was skipped or dropped: the ranks fetch more next
   round); otherwise ``T`` is at least GAS, so every round makes progress. When every rank's
   input is exhausted, ``T`` is the largest bin count, rounded up, and ranks with fewer bins
   fill with dummies: the epoch ends in that round (I2, I3).
2. Quota closure (``_close_quota``, quota mode): in the round where the quota is reached, bins
   are taken position-major round-robin over ranks and the last one is cut, so exactly
   ``quota`` samples are trained and only the last step holds dummies (given ``window >= GAS``
   and no empty static shard). A run whose first full pass over the data admits no sample (all
   skipped or dropped over the cap) can never reach its quota: every rank raises
   :class:`NoSampleAdmitted`.
3. The next indices each rank receives (``_deal``, dynamic sharding): the ranks whose pending
   work is smallest get more, by water-filling on estimated cost; near the end of the stream
   part is held back so all ranks run out together (the policy: :class:`odb.batching.stream.Dealer`).
   Nothing is dealt in a drain round or in the round that closes the quota.
4. Which bin goes to which slot (``_slots``): each rank's taken bins sorted by cost, then one
   permutation shared by all ranks, so the micro-batches that meet at each ZeRO sync point cost
   about the same. A bin cut by the quota counts with the samples it keeps (``_bin_figures``:
   quota-mode proposals carry per-sample tokens and cost steps,
   :meth:`odb.batching.packer.Bin.cost_steps`, beside the label tokens).
   Long bins first (``_place_long``, over_cap 'sequence_parallel'): a bin of one sample over
   ``max_tokens`` is trained by the aligned group of ``d`` consecutive ranks that holds its rank
   (``d``: the smallest of ``degrees`` that holds it at ``max_tokens`` a rank), at one position:
   the first where every rank of the group is free. Each rank's first long bin, then each one's
   second, ..., the ranks taking turns at going first; a long bin that finds no free position this
   round stays in the window. Every rank of a group then has that position taken, and fills its
   other positions with its own ready bins, fullest first, costliest at the first positions; the
   bins that no longer fit stay in the window (carry). In the drain round ``T`` grows to hold them all.
5. ``N_step`` (``_totals``): the label tokens of every step over all ranks, known before its
   first backward (I4); with them the samples of every step and the cost and tokens per slot.

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
* long samples (over_cap 'sequence_parallel'): a rank's long bin may wait for its group to be free
  while its rank trains its other bins, so the static-shard bound above does not hold there; a
  round with ``T > 0`` still trains at least one bin (the first long bin placed has every position
  free, or the ranks' own bins fill them), and each round the ranks take turns at placing first.
* dummies: a rank that still expects input gets at most ``GAS - 1`` in a round when it holds
  fewer than GAS samples, ``GAS`` when every sample it fetched was skipped or dropped; a rank whose
  input is used up gets ``T - bins`` (it joins the others' steps with zero-weight passes, as I1
  requires).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from odb.batching.cost import SampleCost, group_for
from odb.batching.stream import Dealer
from odb.batching.wire import PROPOSAL_SCALARS

__all__ = ["Decision", "MicroBatch", "NoSampleAdmitted", "Shared", "StepPlan", "decide"]


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
    shared: np.ndarray | None = None
    """``[world, T]``: at a position where a group of ranks trains a long sample, its owner's rank
    on every rank of the group (the owner's slot is the sample's bin); -1 elsewhere. None: no long
    sample this round."""


def decide(fields: Mapping[str, np.ndarray], *, gas: int, seed: int, epoch: int, round_index: int,
           quota_left: int | None, stream_left: int | None, inflight_target: int,
           stream_ready: int | None = None, window: int | None = None, max_tokens: int = 0,
           degrees: tuple[int, ...] = ()) -> Decision:
    """The round decision from the gathered proposals as decoded by
    :func:`odb.batching.wire.proposal_layout` (scalars ``[world]``, arrays ``[world, slots]``), in the
    five phases of the module docstring.

    Args:
        gas: micro-batches per step.
        seed, epoch, round_index: seed the permutation of slots shared by all ranks.
        quota_left: samples still to train in quota mode, ``None`` in join mode.
        stream_left: indices not yet dealt (``None``: static shards, nothing to deal).
        stream_ready: of those, how many may be dealt now (``None``: all; a data mixture's).
        window: samples a rank's window holds (with ``stream_ready``: whether a rank can still fetch).
        inflight_target: samples each rank should hold or expect (window + lookahead).
        max_tokens, degrees: over_cap 'sequence_parallel': a bin over ``max_tokens`` is a long
            sample, trained by a group of ranks of the smallest of ``degrees`` that holds it.

    Raises:
        NoSampleAdmitted: quota mode, on every rank alike, once a full pass admitted nothing.
    """
    g = _unpack(fields)
    dealer = Dealer(stream_left, inflight_target, observed_cost=g.fields["observed_cost"].sum(),
                    observed_cost_sq=g.fields["observed_cost_sq"].sum(),
                    observed_samples=int(g.fields["observed_samples"].sum()), stream_ready=stream_ready)
    target, is_drain = _target(g, gas, dealer, window)  # 1
    take, target, cut, is_quota_done = _close_quota(g, target, quota_left, gas)  # 2
    taken, long = _first(take, g.costs), None  # each rank's bins trained this round
    if degrees and (g.tokens > max_tokens).any():  # (4, first: it changes what each rank takes)
        ready = np.maximum(take, np.minimum(g.fields["num_ready"], g.num_bins))
        taken, target, long = _place_long(g.tokens, take, ready, target, gas, is_drain, max_tokens, degrees,
                                          first=round_index)
    new_indices = [0] * len(take) if is_drain or is_quota_done else _deal(g, dealer, taken)  # 3
    figures = _bin_figures(g, cut)  # 4
    shuffle = None if is_quota_done else np.random.default_rng([seed, epoch, round_index])
    slots, shared = _slots(figures.costs, taken, target, shuffle, long)
    totals = _totals(figures, slots, taken, gas, shared)  # 5
    return Decision(slots=slots.tolist(), cut=cut, step_label_tokens=totals.step_label_tokens,
                    step_samples=totals.step_samples, slot_costs=totals.slot_costs,
                    slot_tokens=totals.slot_tokens, samples_taken=totals.samples_taken,
                    new_indices=new_indices, is_epoch_done=is_drain or is_quota_done,
                    is_quota_done=is_quota_done, shared=shared)


class _Gathered(NamedTuple):
    """The gathered proposals, cut to the columns in use (``B``: the most bins any rank holds,
    ``S``: the most samples)."""

    fields: Mapping[str, np.ndarray]  # each of PROPOSAL_SCALARS -> [world]
    costs: np.ndarray  # [world, B] per ranked bin
    samples: np.ndarray  # [world, B]
    tokens: np.ndarray  # [world, B]
    labels: np.ndarray  # [world, S] per sample, bin after bin
    sample_tokens: np.ndarray | None  # [world, S], quota mode only
    sample_costs: np.ndarray | None  # [world, S], quota mode only

    @property
    def num_bins(self) -> np.ndarray:
        return self.fields["num_bins"]


def _unpack(fields: Mapping[str, np.ndarray]) -> _Gathered:
    used_bins = int(fields["num_bins"].max())
    costs, samples, tokens = (fields[name][:, :used_bins] for name in ("bin_costs", "bin_samples", "bin_tokens"))
    used = int(samples.sum(axis=1).max()) if used_bins else 0
    per_sample = [fields[name][:, :used] if name in fields else None
                  for name in ("sample_labels", "sample_tokens", "sample_costs")]
    return _Gathered({name: fields[name] for name in PROPOSAL_SCALARS}, costs, samples, tokens, *per_sample)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _first(take: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``[world, B]`` mask of each rank's first ``take[r]`` ranked bins."""
    return np.arange(like.shape[1])[None, :] < take[:, None]


# ---- phase 1: T --------------------------------------------------------------------------------

def _target(g: _Gathered, gas: int, dealer: Dealer, window: int | None = None) -> tuple[int, bool]:
    """``T`` and whether this is the drain round (see the module docstring)."""
    num_bins = g.num_bins
    active = g.fields["is_exhausted"] == 0
    if not active.any():  # drain: every rank's input is used up (nothing is left to deal)
        return _round_up(int(num_bins.max()), gas), True
    target = int(g.fields["num_ready"][active].min()) // gas * gas
    # a data mixture may deal more once the records in flight are measured: wait for that, while
    # some rank can still fetch them (pending records and room in its window)
    can_fetch = window is not None and bool(((g.fields["num_pending"] > 0)
                                              & (g.fields["window_samples"] < window)).any())
    if target == 0 and num_bins.any() and not any(_deal(g, dealer, np.zeros(g.costs.shape, dtype=bool))) \
            and not (dealer.is_waiting and can_fetch):
        target = gas  # nothing to wait for: train what there is, so every round makes progress
    # No rank holds a bin and nothing is dealt: T = 0; every active rank fetches more next round.
    return target, False


# ---- phase 2: quota closure --------------------------------------------------------------------

def _close_quota(g: _Gathered, target: int, quota_left: int | None, gas: int):
    """``(take, T, cut, is_quota_done)``: each rank's first ``min(bins, T)`` unless this round
    reaches the quota; then position-major round-robin over ranks until exactly ``quota_left``
    samples, the last bin cut to fit."""
    take = np.minimum(g.num_bins, target)
    if quota_left is None:
        return take, target, None, False
    _check_quota_reachable(g.fields, quota_left)
    if not target or int((g.samples * _first(take, g.samples)).sum()) < quota_left:
        return take, target, None, False
    world = g.samples.shape[0]
    take = np.zeros(world, dtype=np.int64)
    count = 0
    for position in range(int(g.num_bins.max())):
        for r in range(world):
            if position >= g.num_bins[r]:
                continue
            n = int(g.samples[r, position])
            take[r] += 1
            if count + n >= quota_left:
                keep = quota_left - count
                cut = (r, position, keep) if keep < n else None
                return take, _round_up(int(take.max()), gas), cut, True
            count += n
    raise AssertionError("quota closure called without enough samples")


def _check_quota_reachable(fields: Mapping[str, np.ndarray], quota_left: int) -> None:
    """Raise on every rank alike once the first pass over the data is fetched and admitted nothing."""
    if fields["observed_samples"].sum() or fields["is_first_pass_open"].any():
        return
    skipped, dropped = int(fields["num_skipped"].sum()), int(fields["num_dropped"].sum())
    raise NoSampleAdmitted(
        f"quota mode: a full pass over the data admitted no sample: {skipped} skipped (the data layer "
        f"returned None), {dropped} dropped over the cap; the {quota_left} samples left of the quota can "
        "never be trained. Fix the data or its format (e.g. records without an assistant turn), or "
        "raise --max_tokens / --max_patches or set --over_cap truncate")


# ---- phase 3: the next indices -----------------------------------------------------------------

def _deal(g: _Gathered, dealer: Dealer, took: np.ndarray) -> list[int]:
    """New indices per rank when each rank trains the bins ``took`` marks (``[world, B]``; the rest
    carries)."""
    carry_cost = g.fields["window_cost"] - (g.costs * took).sum(axis=1)
    carry_samples = g.fields["window_samples"] - (g.samples * took).sum(axis=1)
    return dealer(carry_cost, carry_samples, g.fields["num_pending"])


# ---- phase 4: which bin at which slot ----------------------------------------------------------

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


class _Long(NamedTuple):
    """The long bins placed this round: ``position[r, b]`` of rank r's bin b (-1: not a long bin
    placed), and ``owner[r, p]``: the owner of the long bin a group trains at position p that
    holds rank r, or -1."""

    position: np.ndarray  # [world, B]
    owner: np.ndarray  # [world, T]


def _place_long(bin_tokens: np.ndarray, take: np.ndarray, ready: np.ndarray, target: int, gas: int,
                is_drain: bool, max_tokens: int, degrees: tuple[int, ...], first: int = 0
                ) -> tuple[np.ndarray, int, _Long]:
    """Places each taken long bin on its group at one position (the module docstring, phase 4);
    returns the bins each rank trains (``[world, B]``: its placed long bins, then as many of its
    ``ready`` bins as its free positions hold, fullest first), ``T`` (grown in the drain round to
    hold every bin) and the placement. Ranks take turns at going first (``first``: the round)."""
    world, width = bin_tokens.shape
    over = bin_tokens > max_tokens
    taken = _first(take, bin_tokens)
    limit = target if not is_drain else _round_up(width * world + 1, max(gas, 1))  # (a drain round: room for all)
    busy = np.zeros((world, limit), dtype=bool)
    position = np.full((world, width), -1, dtype=np.int64)
    owner = np.full((world, limit), -1, dtype=np.int64)
    ranks, bins = np.nonzero(taken & over)
    for b, _, r in sorted(zip(bins.tolist(), ((ranks - first) % world).tolist(), ranks.tolist())):
        # (each rank's first long bin, then each one's second, ...)
        d = group_for(int(bin_tokens[r, b]), max_tokens, degrees)
        group = slice(r // d * d, r // d * d + d)
        free = np.flatnonzero(~busy[group].any(axis=0))
        if not len(free):
            continue  # it waits for the next round (its rank's other bins may still go)
        p = int(free[0])
        busy[group, p] = True
        position[r, b], owner[group, p] = p, r
    placed = position >= 0
    ordinary = ~over & (np.arange(width)[None, :] < ready[:, None])
    room = limit - busy.sum(axis=1)
    trained = placed | (ordinary & (np.cumsum(ordinary, axis=1) <= room[:, None]))
    if is_drain:
        assert (placed == (taken & over)).all(), "a drain round has room for every long bin"
        used = np.flatnonzero(busy.any(axis=0))  # (a group may wait past its ranks' own counts)
        T = _round_up(max(int((busy.sum(axis=1) + ordinary.sum(axis=1)).max()), int(used[-1]) + 1 if len(used) else 0),
                      gas)
    else:
        T = target
    return trained, T, _Long(position, owner[:, :T])


def _slots(bin_costs: np.ndarray, taken: np.ndarray, target: int, shuffle: np.random.Generator | None,
           long: _Long | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``[world, T]``: the bins each rank trains (``taken``, ``[world, B]``) by cost (descending),
    then dummies (-1); then the positions permuted by ``shuffle`` (the same permutation on every
    rank). With ``long`` (:func:`_place_long`), its long bins at their positions first, and the
    groups' owners at the same positions (``[world, T]``, else None)."""
    world = len(taken)
    width = int(np.flatnonzero(taken.any(axis=0))[-1]) + 1 if taken.any() else 0
    taken = taken[:, :width]
    slots = np.full((world, target), -1, dtype=np.int64)
    if long is None:
        order = np.argsort(np.where(taken, -bin_costs[:, :width], 1), axis=1, kind="stable")
        slots[:, :width] = np.where(np.take_along_axis(taken, order, 1), order, -1)
        owner = None
    else:
        owner = long.owner
        for r in range(world):
            is_long = long.position[r, :width] >= 0
            slots[r, long.position[r, :width][is_long]] = np.flatnonzero(is_long)
            rest = [b for b in np.argsort(-bin_costs[r, :width], kind="stable") if taken[r, b] and not is_long[b]]
            free = np.flatnonzero(owner[r] < 0)[:len(rest)]
            slots[r, free] = rest
    if target and shuffle is not None:
        permutation = shuffle.permutation(target)
        slots = slots[:, permutation]
        owner = None if owner is None else owner[:, permutation]
    return slots, owner


# ---- phase 5: N_step ---------------------------------------------------------------------------

class _Totals(NamedTuple):
    step_label_tokens: list[int]  # N_step of each step, over all ranks
    step_samples: list[int]
    slot_costs: np.ndarray  # [world, T]
    slot_tokens: np.ndarray  # [world, T]
    samples_taken: list[int]  # per rank


def _totals(figures: _BinFigures, slots: np.ndarray, taken: np.ndarray, gas: int,
            shared: np.ndarray | None = None) -> _Totals:
    """Each figure at the slots (0 for dummies), summed per step over ranks and GAS slots. A long
    sample counts once, at its owner; the other ranks of its group carry its cost (each trains a
    slice as costly as the owner's)."""
    valid = slots >= 0
    if valid.any():
        safe = np.where(valid, slots, 0)
        costs, tokens, labels, samples = (np.where(valid, np.take_along_axis(v, safe, 1), 0) for v in figures)
    else:  # no bins at all (possibly zero columns to index)
        costs, tokens, labels, samples = (np.zeros(slots.shape, dtype=np.int64) for _ in figures)
    if shared is not None:
        hosted = (shared >= 0) & ~valid
        costs[hosted] = costs[shared[hosted], np.nonzero(hosted)[1]]
    trained = (figures.samples * taken).sum(axis=1)
    return _Totals(_per_step(labels, gas), _per_step(samples, gas), costs, tokens, [int(x) for x in trained])


def _per_step(slot_values: np.ndarray, gas: int) -> list[int]:
    """Sums over ranks and over the GAS slots of each step (no steps: an empty list)."""
    return [int(x) for x in slot_values.sum(axis=0).reshape(-1, gas).sum(axis=1)]
