"""The round decision: a pure function of what every rank gathered (the plans it makes: :mod:`odb.batching.plan`).

One round (see :mod:`odb.batching.align` for the protocol): every rank packs its window, orders
its bins (the ones to train first first) and sends one int64 vector, its *proposal*
(:func:`odb.batching.wire.proposal_layout`, cut to the bins it holds). After the one gather every rank runs
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
   part is held back so all ranks run out together (the policy: :class:`odb.batching.deal.Dealer`).
   Nothing is dealt in a drain round or in the round that closes the quota.
4. Which bin goes to which slot (:mod:`odb.batching.placement`): each rank's taken bins sorted
   by cost, then one permutation shared by all ranks, so the micro-batches that meet at each ZeRO sync point cost
   about the same. A bin cut by the quota counts with the samples it keeps (``bin_figures``:
   quota-mode proposals carry per-sample tokens and cost steps,
   :meth:`odb.batching.packer.Bin.cost_steps`, beside the label tokens).
   Long bins first (``place_long``, over_cap 'sequence_parallel'): a bin of one sample over
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
from typing import NamedTuple

import numpy as np

from odb.batching.deal import Dealer
from odb.batching.gathered import Gathered, first_bins, round_up, unpack
from odb.batching.placement import BinFigures, assign_slots, bin_figures, place_long
from odb.batching.plan import Decision, NoSampleAdmitted

__all__ = ["decide"]


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
    g = unpack(fields)
    dealer = Dealer(stream_left, inflight_target, observed_cost=g.fields["observed_cost"].sum(),
                    observed_cost_sq=g.fields["observed_cost_sq"].sum(),
                    observed_samples=int(g.fields["observed_samples"].sum()), stream_ready=stream_ready)
    target, is_drain = _target(g, gas, dealer, window)  # 1
    take, target, cut, is_quota_done = _close_quota(g, target, quota_left, gas)  # 2
    taken, long = first_bins(take, g.costs), None  # each rank's bins trained this round
    if degrees and (g.tokens > max_tokens).any():  # (4, first: it changes what each rank takes)
        ready = np.maximum(take, np.minimum(g.fields["num_ready"], g.num_bins))
        taken, target, long = place_long(g.tokens, take, ready, target, gas, is_drain, max_tokens, degrees,
                                          first=round_index)
    new_indices = [0] * len(take) if is_drain or is_quota_done else _deal(g, dealer, taken)  # 3
    figures = bin_figures(g, cut)  # 4
    shuffle = None if is_quota_done else np.random.default_rng([seed, epoch, round_index])
    slots, shared = assign_slots(figures.costs, taken, target, shuffle, long)
    totals = _totals(figures, slots, taken, gas, shared)  # 5
    return Decision(slots=slots, cut=cut, step_label_tokens=totals.step_label_tokens,
                    step_samples=totals.step_samples, slot_costs=totals.slot_costs,
                    slot_tokens=totals.slot_tokens, samples_taken=totals.samples_taken,
                    new_indices=new_indices, is_epoch_done=is_drain or is_quota_done,
                    is_quota_done=is_quota_done, shared=shared)


# ---- phase 1: T --------------------------------------------------------------------------------

def _target(g: Gathered, gas: int, dealer: Dealer, window: int | None = None) -> tuple[int, bool]:
    """``T`` and whether this is the drain round (see the module docstring)."""
    num_bins = g.num_bins
    active = g.fields["is_exhausted"] == 0
    if not active.any():  # drain: every rank's input is used up (nothing is left to deal)
        return round_up(int(num_bins.max()), gas), True
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

def _close_quota(g: Gathered, target: int, quota_left: int | None, gas: int):
    """``(take, T, cut, is_quota_done)``: each rank's first ``min(bins, T)`` unless this round
    reaches the quota; then position-major round-robin over ranks until exactly ``quota_left``
    samples, the last bin cut to fit."""
    take = np.minimum(g.num_bins, target)
    if quota_left is None:
        return take, target, None, False
    _check_quota_reachable(g.fields, quota_left)
    if not target or int((g.samples * first_bins(take, g.samples)).sum()) < quota_left:
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
                return take, round_up(int(take.max()), gas), cut, True
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

def _deal(g: Gathered, dealer: Dealer, took: np.ndarray) -> list[int]:
    """New indices per rank when each rank trains the bins ``took`` marks (``[world, B]``; the rest
    carries)."""
    carry_cost = g.fields["window_cost"] - (g.costs * took).sum(axis=1)
    carry_samples = g.fields["window_samples"] - (g.samples * took).sum(axis=1)
    return dealer(carry_cost, carry_samples, g.fields["num_pending"])


# ---- phase 5: N_step ---------------------------------------------------------------------------

class _Totals(NamedTuple):
    step_label_tokens: list[int]  # N_step of each step, over all ranks
    step_samples: list[int]
    slot_costs: np.ndarray  # [world, T]
    slot_tokens: np.ndarray  # [world, T]
    samples_taken: list[int]  # per rank


def _totals(figures: BinFigures, slots: np.ndarray, taken: np.ndarray, gas: int,
            shared: np.ndarray | None = None) -> _Totals:
    """Each figure at the slots (0 for dummies), summed per step over ranks and GAS slots. A long
    sample counts once, at its owner; the other ranks of its group carry its cost (each trains a
    slice as costly as the owner's)."""
    valid = slots >= 0
    if valid.any():  # (one gather of the four figures: [4, world, T])
        picked = np.stack(figures)[:, np.arange(len(slots))[:, None], np.where(valid, slots, 0)] * valid
        costs, tokens, labels, samples = picked
    else:  # no bins at all (possibly zero columns to index)
        costs, tokens, labels, samples = (np.zeros(slots.shape, dtype=np.int64) for _ in figures)
    if shared is not None:
        hosted = (shared >= 0) & ~valid
        costs[hosted] = costs[shared[hosted], np.nonzero(hosted)[1]]
    trained = (figures.samples * taken).sum(axis=1)
    return _Totals(_per_step(labels, gas), _per_step(samples, gas), costs, tokens, trained.tolist())


def _per_step(slot_values: np.ndarray, gas: int) -> list[int]:
    """Sums over ranks and over the GAS slots of each step (no steps: an empty list)."""
    return [int(x) for x in slot_values.sum(axis=0).reshape(-1, gas).sum(axis=1)]
