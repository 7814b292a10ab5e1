"""A weighted data mixture, dealt online in the unit that trains: pure, no I/O.

Sources lie end to end in one dataset (:class:`odb.data.mixture.MixedDataset`); each has a weight
``w`` (normalized to sum 1) and the mixture holds every source's share of an epoch's trained
``mix_by`` units (``label_tokens``, ``tokens`` or ``samples``) at ``w``. The lengths are known only
once a sample is processed, so the shared stream is extended round by round:

* every rank counts, per source, what it fetched this epoch (records, and the units of those it
  admitted; separately for the source's first pass of the epoch) and sends the counts in the
  round's vector (:attr:`Mixture.layout`, beside the proposal: no collective of its own); after
  the gather every rank holds the same sums (:meth:`Mixture.merge`);
* a source's expected units ``E`` are its observed units plus its dealt, unfetched records at its
  observed mean; its pass level ``U / w`` is one pass over its records (observed, plus the unfetched
  rest at the mean) over its weight;
* the epoch's level ``L`` is the largest pass level (``mix_epoch: "all"``: every record of every
  source at least once; the others are up-sampled, passing over their records again in a new
  seeded order, each repeat a sample of its own) or the smallest (``"first"``: every record at most
  once; the others are down-sampled, a seeded subset of each); a source still owes
  ``(w * L - E) / mean`` records, to the nearest whole one (:meth:`Mixture.left`); under
  ``"first"`` which pass is the lowest is known only once one is drawn whole: until then every
  source owes the rest of its pass and they are drawn in step (:meth:`Mixture.drawable`);
* the next positions of the stream go, one at a time, to the owing source of lowest ``E / w``
  (:meth:`Mixture.draw`), in its pass's seeded order; every rank draws the same.

The epoch ends only once a round's sums show every dealt record fetched (:attr:`Mixture.is_settled`)
and nothing owed: the last estimates are then corrected on observed figures, so each source ends
within about one record (at most one micro-batch's units) of its share. In quota mode there is no
epoch: the stream runs on (sources pass again as needed) and the quota closes the run.

A uid is ``pass * dataset_size + index``, ``pass`` counting the passes over that record's own
source; each epoch starts every source on a fresh pass.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from odb.batching.cost import SampleCost
from odb.batching.wire import Layout

__all__ = ["MIX_BY", "MIX_EPOCH", "Mixture", "epoch_records"]

MIX_BY = ("label_tokens", "tokens", "samples")
"""The unit a mixture's weights share out."""
MIX_EPOCH = ("all", "first")
"""What an epoch of a mixture is: every record of every source at least once, or at most once."""

PROBE = 1
"""Records of a source not measured yet that may be in flight (:meth:`Mixture.drawable`)."""

_COUNTS = ("fetched", "units", "first_fetched", "first_units")  # per source, this epoch


class Mixture:
    """One rank's view of the mixture; every rank holds the same but for its own counts.

    Args:
        sizes: records per source, in dataset order.
        weights: one per source, > 0 (normalized here).
        mix_by: the unit (:data:`MIX_BY`).
        epoch_rule: :data:`MIX_EPOCH`.
        seed: seeds each source's order per pass.
        quota: quota mode: no epochs, the stream runs on.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], *, mix_by: str = "label_tokens",
                 epoch_rule: str = "all", seed: int = 0, quota: bool = False) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"a mixture needs one weight per source, got {len(weights)} for {len(sizes)}")
        if any(int(n) < 1 for n in sizes):
            raise ValueError(f"every source of a mixture needs records, got sizes {list(sizes)}")
        if any(not (w > 0 and math.isfinite(w)) for w in weights):
            raise ValueError(f"mixture weights must be finite and > 0, got {list(weights)}")
        if mix_by not in MIX_BY:
            raise ValueError(f"mix_by must be one of {MIX_BY}, got {mix_by!r}")
        if epoch_rule not in MIX_EPOCH:
            raise ValueError(f"mix_epoch must be one of {MIX_EPOCH}, got {epoch_rule!r}")
        self.sizes = [int(n) for n in sizes]
        largest = float(max(weights))
        total = sum(float(w) / largest for w in weights)
        self.weights = [float(w) / largest / total for w in weights]
        self.mix_by, self.epoch_rule, self.seed, self.quota = mix_by, epoch_rule, seed, quota
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        count = len(self.sizes)
        self.layout = Layout(arrays={f"mix_{name}": count for name in _COUNTS})
        self.cursor = [0] * count  # records drawn from each source over the run (pass = cursor // size)
        self.first_pass = [0] * count  # each source's pass at this epoch's start
        self.dealt = [0] * count  # records drawn this epoch
        self.mine = {name: [0] * count for name in _COUNTS}  # this rank's counts, this epoch
        self.seen = {name: [0] * count for name in _COUNTS}  # every rank's, as of the last round
        self.prior = [0.0] * count  # each source's mean units a record, from earlier epochs (0: none)
        self.closed = False  # nothing more to draw this epoch (a re-dealt state whose epoch was over)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def dataset_size(self) -> int:
        return self.starts[-1]

    def source_of(self, uid: int) -> int:
        return bisect.bisect_right(self.starts, uid % self.dataset_size) - 1

    # ---- the counts, and the round --------------------------------------------------------

    def observe(self, fetched: Sequence[int], admitted: Sequence[SampleCost]) -> None:
        """This rank fetched ``fetched`` (uids) and admitted ``admitted`` of them as ``(uid,
        tokens, label_tokens)`` (the rest were skipped or dropped: no units)."""
        size, mine = self.dataset_size, self.mine
        for uid in fetched:
            source = self.source_of(uid)
            mine["fetched"][source] += 1
            if uid // size == self.first_pass[source]:
                mine["first_fetched"][source] += 1
        unit = self.mix_by
        for sample in admitted:
            source = self.source_of(sample.uid)
            units = 1 if unit == "samples" else getattr(sample, unit)
            mine["units"][source] += units
            if sample.uid // size == self.first_pass[source]:
                mine["first_units"][source] += units

    def fields(self) -> dict[str, Any]:
        """This rank's part of the round's vector."""
        return {f"mix_{name}": values for name, values in self.mine.items()}

    def merge(self, gathered: Mapping[str, np.ndarray]) -> None:
        """After the round's gather: every rank's counts, summed (the same on every rank)."""
        self.seen = {name: gathered[f"mix_{name}"].sum(axis=0).tolist() for name in _COUNTS}

    @property
    def is_settled(self) -> bool:
        """Whether the last round's sums cover every record drawn (nothing is estimated)."""
        return self.closed or sum(self.seen["fetched"]) == sum(self.dealt)

    # ---- what is owed, and drawing it ---------------------------------------------------

    def _means(self) -> list[float]:
        """Each source's mean units a record: its own this epoch; before it has one, its mean of
        earlier epochs, else the mean of every source this epoch, else 1. (The prior weighs a
        hundredth of a record, so that a source whose records so far were all skipped is not
        guessed at 0.)"""
        seen = self.seen
        fetched, units = sum(seen["fetched"]), sum(seen["units"])
        default = units / fetched if fetched and units else 1.0
        return [(seen["units"][i] + 0.01 * (self.prior[i] or default)) / (seen["fetched"][i] + 0.01)
                for i in range(len(self.sizes))]

    def expected(self) -> list[float]:
        """Each source's units this epoch: observed, and its drawn, unfetched records at the mean."""
        means = self._means()
        return [self.seen["units"][i] + (self.dealt[i] - self.seen["fetched"][i]) * means[i]
                for i in range(len(self.sizes))]

    def _passes(self, means: list[float]) -> list[float]:
        """One pass over each source this epoch, in units: observed, and the unfetched rest at the mean."""
        seen = self.seen
        return [seen["first_units"][i] + max(0, size - seen["first_fetched"][i]) * means[i]
                for i, size in enumerate(self.sizes)]

    def owed(self, *, cautious: bool = True) -> list[int]:
        """Records each source still owes this epoch (join mode).

        ``cautious`` (what is drawn): up to the highest *measured* level (units / weight), never an
        estimate, whose error the weights' ratios would magnify in the others; a source near its
        share waits for part of its records in flight; a repeat only once the source's first pass is
        measured. Otherwise (how much of the epoch is left, for the dealer): up to the estimated
        level, every pass's unmeasured rest at its mean. ``"first"``: :meth:`_owed_first`."""
        means, expected, seen = self._means(), self.expected(), self.seen
        passes = self._passes(means)
        active = [i for i in range(len(self.sizes)) if passes[i] > 0]  # a source of no units at all is left out
        rests = [max(0, size - dealt) for size, dealt in zip(self.sizes, self.dealt)]  # of the first pass
        if not active:
            return rests
        if self.epoch_rule == "first":
            return self._owed_first(passes, active, rests, means, expected, cautious)
        level = max(seen["units"][i] / self.weights[i] for i in active)
        if not cautious:
            estimate = max(passes[i] / self.weights[i] for i in active)
            level = max([level, estimate] + [expected[i] / self.weights[i] for i in active])
        out = []
        for i, rest in enumerate(rests):
            records = max(0, round((self.weights[i] * level - expected[i]) / means[i])) if i in active else 0
            if not seen["fetched"][i] and not self.prior[i]:
                records = max(records, 1)  # measure one first
            if cautious:
                records = max(0, records - 2 * math.isqrt(self.dealt[i] - seen["fetched"][i]))
            out.append(max(rest, records))  # every record at least once
        return out

    def _owed_first(self, passes: list[float], active: list[int], rests: list[int], means: list[float],
                    expected: list[float], cautious: bool) -> list[int]:
        """:meth:`owed` under ``"first"``: every source owes the rest of its pass, drawn in step,
        lowest level first (:meth:`draw`), until one has drawn its whole pass; the lowest pass
        level of those is the epoch's, and the others follow it, each at most its pass. (Which
        source that is, guessed from a probe each, would draw a wrong one through before the
        estimates were corrected.) Otherwise (the dealer's estimate): the lowest estimated level."""
        done = [i for i in active if not rests[i]]
        if cautious and not done:
            return rests
        level = min(passes[i] / self.weights[i] for i in (done if cautious else active))
        out = []
        for i, rest in enumerate(rests):
            records = round((self.weights[i] * level - expected[i]) / means[i]) if i in active else 0
            if cautious:
                records -= 2 * math.isqrt(self.dealt[i] - self.seen["fetched"][i])
            out.append(min(max(0, records), rest))
        return out

    def drawable(self) -> list[int]:
        """What each source may draw now: what it owes (quota mode: no end); but a source without a
        measured mean yet (its first epoch) has at most ``PROBE`` records, or twice what was measured,
        in flight, beyond the first pass it owes whole ("all"): a source guessed cheap is not drawn
        by the hundred before one is measured. Under ``"first"`` so is a source whose records fetched
        this epoch all gave no units (skipped): its mean is then its prior's hundredth, so it would
        be the lowest level drawn in step and drawn through in one deal (a later epoch, one skipped
        record first: 9705 tokens against a share of 750). Nothing in a closed epoch (re-dealt after
        it was over: its draws were reset when the next began, so the held records it fetches again
        are no measure of what it owes)."""
        seen = self.seen
        if self.closed:
            return [0] * len(self.sizes)
        if self.quota:  # no end; but a source whose whole first pass gave no units is left out
            owed = [0 if seen["first_fetched"][i] >= size and not seen["first_units"][i] else 1 << 62
                    for i, size in enumerate(self.sizes)]
        else:
            owed = self.owed()
        out = []
        for i, owes in enumerate(owed):
            if not self.prior[i] or (self.epoch_rule == "first" and seen["fetched"][i] and not seen["units"][i]):
                in_flight = self.dealt[i] - self.seen["fetched"][i]
                owes = min(owes, max(0, max(PROBE, 2 * self.seen["fetched"][i]) - in_flight))
            out.append(owes)
        return self._in_step(out) if self.epoch_rule == "first" and not self.quota else out

    def _in_step(self, caps: list[int]) -> list[int]:
        """``"first"`` before any source's pass is drawn whole: the sources are drawn in step, lowest
        level first, so the first drawn through is the one of the lowest pass level (:meth:`owed`).
        Of ``caps``, what :meth:`draw` reaches before a source that may draw no more now (its probes
        in flight: the others would run ahead of it) or the end of a pass (the level is then set)."""
        rests = [size - dealt for size, dealt in zip(self.sizes, self.dealt)]
        if any(rest <= 0 and units > 0 for rest, units in zip(rests, self._passes(self._means()))):
            return caps  # the level is set: the others follow it
        out = [0] * len(caps)
        for i in self._order(caps, rests):
            out[i] += 1
        return out

    def _order(self, caps: list[int], rests: list[int] | None = None) -> Iterator[int]:
        """The sources in the order :meth:`draw` takes them, each at most ``caps`` times: the lowest
        level (expected units / weight) first; under ``"first"`` with twice the square root of a
        source's records in flight added at its mean (what they may hold above it), so that a
        source is not drawn past the level on an estimate. ``rests`` (drawing in step): stop at a
        source whose cap is spent, or once one has drawn its ``rests``."""
        means, expected = self._means(), self.expected()
        flight = [dealt - fetched for dealt, fetched in zip(self.dealt, self.seen["fetched"])]
        pad = [0] * len(caps)
        if self.epoch_rule == "first" and not self.quota:  # all but the likeliest anchor keep behind it
            passes = self._passes(means)
            anchor = min(range(len(caps)), key=lambda i: (passes[i] <= 0, passes[i] / self.weights[i], i))
            pad = [2 * (i != anchor) for i in range(len(caps))]

        def level(i: int) -> float:
            return (expected[i] + pad[i] * math.isqrt(flight[i]) * means[i]) / self.weights[i]

        left, drawn = list(caps), [0] * len(caps)
        heap = [(level(i), i) for i, cap in enumerate(caps) if cap > 0 or (rests is not None and rests[i] > 0)]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            if left[i] <= 0:
                return
            yield i
            left[i] -= 1
            drawn[i] += 1
            expected[i] += means[i]
            flight[i] += 1
            if rests is not None and drawn[i] == rests[i]:
                return
            if left[i] > 0 or rests is not None:
                heapq.heappush(heap, (level(i), i))

    def left(self) -> int:
        """Stream positions still to draw this epoch: an estimate, for the dealer, until a round's
        sums cover every record drawn; then exactly what is owed (0: the epoch may end)."""
        if self.closed:
            return 0
        if self.quota:
            return 1 << 62
        drawable = sum(self.drawable())
        return drawable if self.is_settled else max(drawable, sum(self.owed(cautious=False)))

    def epoch_estimate(self) -> int:
        """Records this epoch draws in all: those drawn, and those still owed (an estimate until its
        last rounds); the same on every rank (a learning-rate schedule's length)."""
        return sum(self.dealt) + (0 if self.closed else sum(self.owed(cautious=False)))

    def draw(self, count: int) -> list[int]:
        """The next positions of the shared stream, as uids, at most ``count`` (fewer when less may
        be drawn now: :meth:`drawable`); the same on every rank."""
        return [self._next_uid(i) for i in itertools.islice(self._order(self.drawable()), count)]

    def _next_uid(self, source: int) -> int:
        size = self.sizes[source]
        passed, offset = divmod(self.cursor[source], size)
        cached = self._orders.get(source)
        if cached is None or cached[0] != passed:
            cached = (passed, np.random.default_rng([self.seed, source, passed]).permutation(size))
            self._orders[source] = cached
        self.cursor[source] += 1
        self.dealt[source] += 1
        return passed * self.dataset_size + self.starts[source] + int(cached[1][offset])

    def is_first_pass_open(self) -> bool:
        """Whether some source has not yet been drawn through once in the run."""
        return any(cursor < size for cursor, size in zip(self.cursor, self.sizes))

    def next_epoch(self) -> None:
        """Every source starts a fresh pass; this epoch's means become the next one's priors."""
        means = self._means()
        for i, size in enumerate(self.sizes):
            if self.seen["fetched"][i]:
                self.prior[i] = means[i]
            self.cursor[i] = -(-self.cursor[i] // size) * size
            self.first_pass[i] = self.cursor[i] // size
        count = len(self.sizes)
        self.closed = False
        self.dealt = [0] * count
        self.mine = {name: [0] * count for name in _COUNTS}
        self.seen = {name: [0] * count for name in _COUNTS}

    # ---- state (I6) -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "mix_by": self.mix_by, "cursor": list(self.cursor),
                "first_pass": list(self.first_pass), "dealt": list(self.dealt),
                "mine": {k: list(v) for k, v in self.mine.items()}, "seen": {k: list(v) for k, v in self.seen.items()},
                "prior": list(self.prior), "closed": self.closed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor, self.first_pass = list(state["cursor"]), list(state["first_pass"])
        self.dealt, self.prior = list(state["dealt"]), [float(p) for p in state["prior"]]
        self.closed = bool(state["closed"])
        self.mine = {k: list(state["mine"][k]) for k in _COUNTS}
        self.seen = {k: list(state["seen"][k]) for k in _COUNTS}
        if list(state["sizes"]) != self.sizes or state["mix_by"] != self.mix_by:
            raise ValueError(f"the state's mixture has sources of {state['sizes']} records mixed by "
                             f"{state['mix_by']!r}, this run {self.sizes} by {self.mix_by!r}: resume with the "
                             "same data")


def epoch_records(sizes: Sequence[int], weights: Sequence[float], means: Sequence[float] | None = None, *,
                  epoch_rule: str) -> list[int]:
    """Each source's records in one epoch of a mixture when its records carry ``means`` units on
    average (None: all alike, the estimate before any sample is measured): :class:`Mixture`'s rule
    in closed form. The level ``L`` is the largest (``"all"``) or smallest (``"first"``) pass level
    ``size * mean / w`` of the sources with units; each such source draws ``w * L / mean`` records,
    at least its whole pass (``"all"``) or at most it (``"first"``); a source of no units draws its
    pass (``"all"``) or nothing. Exact for ``mix_by: samples`` with no record skipped (every mean
    1), up to the last records' rounding."""
    if epoch_rule not in MIX_EPOCH:
        raise ValueError(f"mix_epoch must be one of {MIX_EPOCH}, got {epoch_rule!r}")
    means = [1.0] * len(sizes) if means is None else means
    total = sum(float(w) for w in weights)
    shares = [float(w) / total for w in weights]
    active = [i for i, mean in enumerate(means) if mean > 0]
    if not active:
        return list(sizes) if epoch_rule == "all" else [0] * len(sizes)
    levels = [sizes[i] * means[i] / shares[i] for i in active]
    level = max(levels) if epoch_rule == "all" else min(levels)
    out = []
    for i, size in enumerate(sizes):
        records = round(shares[i] * level / means[i]) if i in active else 0
        out.append(int(max(size, records) if epoch_rule == "all" else min(size, records)))
    return out
