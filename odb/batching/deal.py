"""Dynamic dealing: how many of the shared stream's next indices each rank receives in a round.

The policy behind phase 3 of the round decision (:mod:`odb.batching.decide`): the ranks whose
pending work is smallest get more (:func:`waterfill` on estimated cost, :class:`Dealer`), and near
the end of the stream part is held back so that all ranks run out together (:func:`deal_budget`).
Every input is gathered, so every rank deals alike."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Dealer", "deal_budget", "waterfill"]


def waterfill(loads, unit: int, total: int, caps) -> list[int]:
    """Deal up to ``total`` items of weight ``unit``, at most ``caps[r]`` to rank r, so that the
    largest final load is smallest.

    Same result as giving each item in turn to the least-loaded rank that has room (ties to the
    lower rank), computed with integers (so every rank gets the same answer) in O(world) numpy
    work per bisection step: O(world * log(unit * max(caps))) in all.
    """
    loads = np.asarray(loads, dtype=np.int64).reshape(-1)
    caps = np.maximum(0, np.asarray(caps, dtype=np.int64).reshape(-1))
    total = min(int(total), int(caps.sum()))
    if total <= 0:
        return [0] * len(loads)

    def fill(level: int) -> np.ndarray:
        return np.minimum(caps, np.maximum(0, (level - loads) // unit))

    # the largest level whose whole-unit fill stays within total; past max(loads) + unit * max(caps)
    # every rank is full, so the search stops there (the same counts as any higher level)
    low, high = int(loads.min()), int(loads.max()) + unit * int(caps.max())
    while low < high:
        mid = (low + high + 1) // 2
        if int(fill(mid).sum()) <= total:
            low = mid
        else:
            high = mid - 1
    counts = fill(low)
    rest = total - int(counts.sum())
    if rest:
        room = np.flatnonzero(counts < caps)
        order = room[np.argsort(loads[room] + counts[room] * unit, kind="stable")]  # (ties: the lower rank)
        counts[order[:rest]] += 1
    return counts.tolist()


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


class Dealer:
    """The dynamic policy in one round: how many of the next stream indices each rank receives.

    A rank's load is the cost of what it carries into the next round plus its dealt, unprocessed
    indices at the observed mean cost; the least-loaded ranks get more (:func:`waterfill`), up to
    ``inflight_target`` samples held or expected per rank, at most :func:`deal_budget` in all.
    Every figure is gathered (the same on every rank), so every rank deals alike.

    Args:
        stream_left: indices not dealt yet (``None``: static shards; 0: none left).
        stream_ready: of those, how many may be dealt now (``None``: all; a data mixture draws only
            what its measured figures allow, :meth:`odb.batching.mixture.Mixture.drawable`).
        inflight_target: samples a rank should hold or expect (window + lookahead).
        observed_cost, observed_cost_sq, observed_samples: admitted samples, all ranks, whole run.
    """

    def __init__(self, stream_left: int | None, inflight_target: int, *, observed_cost, observed_cost_sq,
                 observed_samples: int, stream_ready: int | None = None) -> None:
        self.stream_left, self.inflight_target, self.stream_ready = stream_left, inflight_target, stream_ready
        self.unit, self.spread = 1, 1.0  # nothing observed yet: cost 1 a sample, spread 1
        if observed_samples:
            mean = observed_cost / observed_samples
            self.unit = max(1, int(mean))
            var = observed_cost_sq / observed_samples - mean * mean
            self.spread = math.sqrt(max(0.0, var)) / mean

    @property
    def is_waiting(self) -> bool:
        """Whether indices are left that may not be dealt yet (a data mixture's, until the records in
        flight are measured): the next rounds deal them."""
        return self.stream_ready is not None and bool(self.stream_left) and self.stream_ready < self.stream_left

    def __call__(self, carry_cost: np.ndarray, carry_samples: np.ndarray, num_pending: np.ndarray) -> list[int]:
        """Counts per rank, from each rank's carried cost and samples and its pending indices ``[world]``."""
        world, left = len(num_pending), self.stream_left
        if not left:
            return [0] * world
        room = self.inflight_target - (carry_samples + num_pending)
        loads = carry_cost + num_pending * self.unit
        budget = deal_budget(left, world, self.inflight_target, self.spread)
        if self.stream_ready is not None:
            budget = min(budget, self.stream_ready)
        return waterfill(loads, self.unit, budget, room)
