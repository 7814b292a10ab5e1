"""A weighted mixture of streaming sources, drawn on each rank from its own readers: pure, no I/O.

A streaming source has no record numbers to deal from one shared stream (:mod:`odb.batching.mixture`
draws the indexed mixture that way), so a streamed mixture is drawn where its records are read: on
each rank, from that rank's reader of each source (:class:`odb.batching.stream.Reader`: the rank's
shards of the source's pass). :class:`MixedReader` is one rank's reader of the mixture; the
stream keeps ``window + lookahead`` of what it reads pending, as for one streaming source.

What it draws, per rank, in the ``mix_by`` unit (``label_tokens``, ``tokens``, ``samples``), the
weights ``w`` normalized to sum 1:

* a source's expected units ``E`` are those of its fetched records (:meth:`MixedReader.observe`)
  plus its records in flight at its mean; its level is ``E / w``; each record goes to the source of
  lowest level that may draw (a source not measured yet has at most ``PROBE`` records in flight, or
  twice what was measured, as in the indexed mixture);
* ``mix_epoch: "all"``: every source's first pass (the rank's shards of it) is read whole; a source
  whose first pass is read may draw repeats (a fresh pass over the shards of the repeat's own
  seeded deal) while its level is below the target ``L``: the largest pass level ``P / w`` of the
  passes fully measured, and the level of every source still in its first pass (which only grows);
* ``"first"``: no record twice; once a source's first pass is read and measured, ``L`` is its pass
  level, and the others draw up to it, to the nearest record;
* the rank's epoch ends once nothing is in flight and no source may draw on measured figures.

So on each rank every source ends within about one record's units of ``w * L_r``, and over the
ranks within about one record a rank of ``w * sum(L_r)``: the shares of the whole hold as they do
for the indexed mixture, counted per rank. What differs from it (nothing is indexed, each rank
reads only its shards): ``"all"`` repeats come from whole shards in the stream's order, mixed only
by the buffer, and ``"first"`` trains the front of each rank's shards of the others (the pass's
seeded deal of shards, the buffer's order), not a seeded subset of the whole source; ``L`` is
each rank's own, so no source is whole over the ranks under ``"first"`` unless it ran out first on
every rank. A rank needs some of every source each pass: every source must have at least as many
shards as ranks (checked where the readers are built).

A uid is ``pass * dataset_size + start[s] + index`` (``index`` within source ``s``'s uid space of
one pass), where the pass of epoch ``e``'s first pass over a source is ``e`` on every rank (so the
rank's shards of it are the pass's deal, exactly once) and its ``j``-th repeat is ``e + j *
num_epochs`` (a pass no first pass uses: each repeat is a sample of its own).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from odb.batching.cost import SampleCost
from odb.batching.mixture import MIX_BY, MIX_EPOCH, PROBE
from odb.batching.stream import Reader

__all__ = ["MixedReader"]

_COUNTS = ("handed", "fetched", "units", "first_handed", "first_fetched", "first_units")  # per source, this epoch


class MixedReader:
    """One rank's reader of a weighted mixture of streaming sources (:class:`odb.batching.stream.Reader`).

    Args:
        readers: this rank's reader of each source, in the dataset's order.
        sizes: each source's uid space of one pass (its ``len``).
        weights: one per source, > 0 (normalized here).
        mix_by: the unit the weights share out (:data:`odb.batching.mixture.MIX_BY`).
        epoch_rule: :data:`odb.batching.mixture.MIX_EPOCH`.
        num_epochs: the run's epochs (a repeat's pass is numbered past every first pass).
    """

    def __init__(self, readers: Sequence[Reader], sizes: Sequence[int], weights: Sequence[float], *,
                 mix_by: str = "label_tokens", epoch_rule: str = "all", num_epochs: int = 1) -> None:
        if not readers or len(readers) != len(sizes) or len(sizes) != len(weights):
            raise ValueError(f"a streamed mixture needs one reader, size and weight per source, got {len(readers)}, "
                             f"{len(sizes)} and {len(weights)}")
        if any(not (w > 0 and math.isfinite(w)) for w in weights):
            raise ValueError(f"mixture weights must be finite and > 0, got {list(weights)}")
        if mix_by not in MIX_BY or epoch_rule not in MIX_EPOCH:
            raise ValueError(f"mix_by must be one of {MIX_BY} and mix_epoch one of {MIX_EPOCH}, got {mix_by!r}, "
                             f"{epoch_rule!r}")
        self.readers, self.sizes = list(readers), [int(n) for n in sizes]
        self.weights = [float(w) / sum(float(v) for v in weights) for w in weights]
        self.mix_by, self.epoch_rule, self.num_epochs = mix_by, epoch_rule, num_epochs
        self.starts = [0]
        for size in self.sizes:
            self.starts.append(self.starts[-1] + size)
        self.epoch, self.rank, self.world_size = 0, 0, 1
        self.repeats = [0] * len(self.sizes)  # each source's repeats this epoch (0: in its first pass)
        self.counts = {name: [0] * len(self.sizes) for name in _COUNTS}
        self.prior = [0.0] * len(self.sizes)  # each source's mean units a record in earlier epochs (0: none)

    @property
    def dataset_size(self) -> int:
        return self.starts[-1]

    def source_of(self, uid: int) -> int:
        return bisect.bisect_right(self.starts, uid % self.dataset_size) - 1

    # ---- the Reader protocol ----------------------------------------------------------------

    @property
    def is_done(self) -> bool:
        """Nothing in flight, and no source may draw on measured figures: the rank's epoch is over."""
        counts = self.counts
        return counts["handed"] == counts["fetched"] and not self._may_draw()

    def start_pass(self, pass_index: int, rank: int, world_size: int) -> None:
        """Epoch ``pass_index``: every source's first pass (pass ``pass_index`` of its reader), this
        epoch's means the next one's priors."""
        if pass_index:
            means = self._means()
            self.prior = [means[i] if self.counts["fetched"][i] else self.prior[i] for i in range(len(self.sizes))]
        self.epoch, self.rank, self.world_size = pass_index, rank, world_size
        self.repeats = [0] * len(self.sizes)
        self.counts = {name: [0] * len(self.sizes) for name in _COUNTS}
        for reader in self.readers:
            reader.start_pass(pass_index, rank, world_size)

    def read(self, count: int) -> list[int]:
        """Up to ``count`` uids, each from the source of lowest expected level that may draw; fewer
        while what may be drawn waits on what is in flight, or once the epoch is over."""
        out: list[int] = []
        while len(out) < count:
            allowed = self._may_draw(expected=True)
            if not allowed:
                break
            levels, means = self._levels(expected=True), self._means()
            # the source whose level would be lowest halfway through its next record: a long record
            # goes once its source is half a record behind, not whenever it is behind at all
            source = min(allowed, key=lambda i: (levels[i] + 0.5 * means[i] / self.weights[i], i))
            uid = self._next(source)
            if uid is not None:
                out.append(uid)
        return out

    def observe(self, fetched: Sequence[int], admitted: Sequence[SampleCost]) -> None:
        """This rank fetched ``fetched`` (uids) and admitted ``admitted`` of them (the rest were
        skipped or dropped: no units)."""
        size, counts = self.dataset_size, self.counts
        for uid in fetched:
            source = self.source_of(uid)
            counts["fetched"][source] += 1
            counts["first_fetched"][source] += uid // size == self.epoch
        for sample in admitted:
            source = self.source_of(sample.uid)
            units = 1 if self.mix_by == "samples" else getattr(sample, self.mix_by)
            counts["units"][source] += units
            if sample.uid // size == self.epoch:
                counts["first_units"][source] += units

    # ---- what may be drawn --------------------------------------------------------------------

    def _means(self) -> list[float]:
        """Each source's mean units a record (a hundredth of a record of its prior, else of every
        source's mean, else 1: a source whose records so far were all skipped is not guessed at 0)."""
        counts = self.counts
        fetched, units = sum(counts["fetched"]), sum(counts["units"])
        default = units / fetched if fetched and units else 1.0
        return [(counts["units"][i] + 0.01 * (self.prior[i] or default)) / (counts["fetched"][i] + 0.01)
                for i in range(len(self.sizes))]

    def _levels(self, *, expected: bool) -> list[float]:
        """Each source's units over its weight: observed, and (``expected``) its records in flight at its mean."""
        counts, means = self.counts, self._means()
        return [(counts["units"][i] + (counts["handed"][i] - counts["fetched"][i]) * means[i] * expected)
                / self.weights[i] for i in range(len(self.sizes))]

    def _may_draw(self, *, expected: bool = False) -> list[int]:
        """The sources that may draw a record now (``expected``: counting what is in flight at the
        means; else on observed figures alone, as when nothing is in flight)."""
        counts, means, levels = self.counts, self._means(), self._levels(expected=expected)
        sources = range(len(self.sizes))
        reading = [not self.repeats[i] and not self.readers[i].is_done for i in sources]
        passes = {i: (counts["first_units"][i] + (counts["first_handed"][i] - counts["first_fetched"][i]) * means[i]
                      * expected) / self.weights[i] for i in sources if not reading[i]}  # first passes read
        if self.epoch_rule == "all":  # the largest pass level (a pass still read: at least its level now)
            target = max([*passes.values(), *(levels[i] for i in sources if reading[i])])
        else:  # the smallest pass level read
            target = min(passes.values(), default=math.inf)
        owing, waiting = [], []
        for i in sources:
            below = (target - levels[i]) * self.weights[i] / means[i] >= 0.5  # a record short, to the nearest
            if reading[i]:
                owes = self.epoch_rule == "all" or below
            else:  # a repeat ("all" only), of a source with units
                owes = self.epoch_rule == "all" and passes[i] > 0 and below
            in_flight = counts["handed"][i] - counts["fetched"][i]
            if owes and not self.prior[i] and in_flight >= max(PROBE, 2 * counts["fetched"][i]):
                waiting.append(i)  # not measured yet: a few in flight at a time
            elif owes:
                owing.append(i)
        # no source runs ahead of one that waits to be measured (it would overshoot its share)
        floor = min((levels[i] for i in waiting), default=math.inf)
        return [i for i in owing if levels[i] <= floor]

    def _next(self, source: int) -> int | None:
        """The next uid of ``source`` (its pass read: the first of its next repeat); None when its
        pass gave none (blank lines only: the caller chooses again)."""
        reader = self.readers[source]
        if reader.is_done:
            self.repeats[source] += 1
            reader.start_pass(self.epoch + self.repeats[source] * self.num_epochs, self.rank, self.world_size)
        uids = reader.read(1)
        if not uids:
            return None
        passed, index = divmod(uids[0], self.sizes[source])
        counts = self.counts
        counts["handed"][source] += 1
        if passed == self.epoch:
            counts["first_handed"][source] += 1
        return passed * self.dataset_size + self.starts[source] + index

    # ---- state (I6) -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"mixed": [reader.state_dict() for reader in self.readers], "epoch": self.epoch,
                "repeats": list(self.repeats), "counts": {k: list(v) for k, v in self.counts.items()},
                "prior": list(self.prior), "sizes": list(self.sizes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state.get("sizes", [])) != self.sizes:
            raise ValueError(f"the state's streamed mixture has sources of {state.get('sizes')} uids a pass, this "
                             f"run {self.sizes}: resume with the same data")
        for reader, part in zip(self.readers, state["mixed"], strict=True):
            reader.load_state_dict(part)
        self.epoch, self.repeats = int(state["epoch"]), [int(r) for r in state["repeats"]]
        self.counts = {k: [int(v) for v in state["counts"][k]] for k in _COUNTS}
        self.prior = [float(p) for p in state["prior"]]
