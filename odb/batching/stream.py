"""The stream of uids a rank trains, and how it is sharded over ranks: pure, no I/O.

A uid is ``epoch * dataset_size + dataset_index``. Every epoch visits the dataset in one
shared, seeded order (:func:`epoch_order`, the same on every rank). Two sharding policies:

* ``static``: rank r takes every ``world``-th index of the epoch's order from position r (like
  torch's ``DistributedSampler``), or its explicit shard, all of it at the start of the epoch.
  In quota mode the shard comes again, in the next epoch's order, whenever fewer than
  ``window + lookahead`` of its uids are pending (re-passes), until the quota closes the run.
* ``static`` over a stream (a :class:`Reader`: a streaming source, :mod:`odb.data.streaming`):
  no list of indices exists; rank r's reader reads its own shards of the pass, and the stream
  keeps ``window + lookahead`` of what it read pending; the rank's input ends when its reader does.
* ``dynamic``: all ranks walk one shared stream, epoch after epoch. The first ``window +
  lookahead`` per rank go out evenly; after that each round's decision says how many of the
  next indices each rank receives (:class:`Dealer`: the least-loaded rank first, :func:`waterfill`;
  held back near the end, :func:`deal_budget`), and every rank cuts the stream the same way, in rank order, so
  each index goes to exactly one rank.

:class:`UidStream` is one rank's side: the uids assigned to it and not fetched yet (``pending``,
in fetch order) and the part of them the rank's feed has not been told yet (:meth:`UidStream.undealt`).
A fresh or restored stream tells its feed nothing until it is asked, so a resumed run never
patches a queue: the batcher hands :meth:`UidStream.undealt` to the feed at its next round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from odb.batching.cost import SampleCost
from odb.batching.deal import deal_budget

__all__ = ["Reader", "UidStream", "epoch_order"]


class Reader(Protocol):
    """A rank's records of a streaming source, read in order (:class:`odb.data.streaming.ShardReader`).

    Its state is plain data with ``segments`` (the shards still to read, ``[shard, offset]``)
    and ``buffer`` (uids read, not handed out yet), which :func:`odb.batching.redeal.redeal_readers`
    deals to another number of ranks."""

    @property
    def is_done(self) -> bool:
        """Whether this rank's part of the pass is all handed out."""

    def start_pass(self, pass_index: int, rank: int, world_size: int) -> None:
        """This rank's part of pass ``pass_index`` (uids ``pass_index * dataset_size + index``)."""

    def read(self, count: int) -> list[int]:
        """Up to ``count`` uids; fewer only once :attr:`is_done` (a streamed mixture,
        :class:`odb.batching.stream_mixture.MixedReader`: also while what it may draw waits on
        records in flight)."""

    def observe(self, fetched: Sequence[int], admitted: Sequence[SampleCost]) -> None:
        """This rank fetched ``fetched`` (uids it read) and admitted ``admitted`` of them (a
        streamed mixture draws by what it measures; one source ignores it)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def epoch_order(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
    """The shared, seeded order of dataset indices for one epoch (identical on every rank)."""
    return np.random.default_rng([seed, epoch]).permutation(dataset_size)


class UidStream:
    """One rank's uids: which it will fetch, in order, under the config's sharding and mode.

    Args:
        config: odb settings (``sharding``, ``mode``, ``seed``, ``window``, ``lookahead``).
        rank, world_size: this rank and the number of ranks.
        dataset_size: samples in the dataset (all ranks).
        shards: optional explicit per-rank lists of dataset indices (static sharding only).
        mixture: a weighted mixture of sources (:mod:`odb.batching.mixture`, dynamic sharding only):
            it draws the shared stream instead of the epoch's order.
        reader: a streaming source's reader (static sharding, join mode): the rank's uids as it
            reads them, instead of a shard of the epoch's order.
    """

    def __init__(self, config, *, rank: int, world_size: int, dataset_size: int,
                 shards: list[list[int]] | None = None, mixture=None, reader: Reader | None = None) -> None:
        if shards is not None and config.sharding != "static":
            raise ValueError("explicit shards need sharding='static'")
        if reader is not None and (config.sharding != "static" or config.mode != "join" or shards is not None):
            raise ValueError("a streaming source is read with sharding 'static' in mode 'join' (each rank reads its "
                             f"own shards, pass after pass), got sharding {config.sharding!r}, mode {config.mode!r}")
        if mixture is not None and config.sharding != "dynamic":
            raise ValueError("a weighted data mixture needs sharding 'dynamic' (the mixture is drawn round by "
                             "round from what every rank has measured); set sharding: dynamic")
        self.mixture, self.reader = mixture, reader
        self.sharding, self.mode, self.seed = config.sharding, config.mode, config.seed
        self.inflight_target = config.window + config.lookahead  # samples a rank holds or expects
        self.rank, self.world_size, self.dataset_size = rank, world_size, dataset_size
        self.shards = shards
        self.epoch = 0
        self.stream_pos = 0  # dynamic: the next position in the shared stream (all epochs)
        self.epoch_of_shard = 0  # static quota mode: the epoch of the latest pass over the shard
        self.pending: list[int] = []  # assigned to this rank, not fetched yet, in fetch order
        self._undealt: list[int] = []  # the tail of what was assigned that the feed was not told
        self._order_epoch, self._order_cache = -1, np.zeros(0, dtype=np.int64)

    # ---- what the round needs to know ---------------------------------------------------------

    @property
    def total_size(self) -> int:
        """Indices in one pass over the data, over all ranks."""
        return sum(len(s) for s in self.shards) if self.shards is not None else self.dataset_size

    def left(self) -> int | None:
        """Indices of the shared stream not dealt yet (``None``: static shards, nothing to deal)."""
        if self.sharding == "static":
            return None
        if self.mixture is not None:
            return self.mixture.left()  # (quota mode: what may be drawn now; the stream runs on)
        if self.mode == "quota":
            return 1 << 62  # the stream runs on until the quota closes the run
        return (self.epoch + 1) * self.dataset_size - self.stream_pos

    def ready(self) -> int | None:
        """Of :meth:`left`, how many may be dealt now (``None``: all of them; a data mixture draws only
        what its measured figures allow)."""
        return sum(self.mixture.drawable()) if self.mixture is not None else None

    def is_tail(self) -> bool:
        """Whether the rest of the epoch's stream fits in flight on every rank at once."""
        left = self.left()
        return left is not None and left <= self.world_size * self.inflight_target

    def is_exhausted(self) -> bool:
        """Whether this rank expects no more uids this epoch."""
        if self.pending:
            return False
        if self.reader is not None:
            return self.reader.is_done
        if self.sharding == "static":
            return self.mode == "join" or not self._shard_size()
        if self.mixture is not None and (self.mode == "quota" or not self.mixture.is_settled):
            return False  # its last estimates are checked on observed figures first (odb.batching.mixture)
        return self.left() == 0

    def is_first_pass_open(self) -> bool:
        """Whether indices of the run's first pass over the data are still to be fetched here."""
        if self.mixture is not None and self.mixture.is_first_pass_open():
            return True
        if self.mixture is None and self.sharding == "dynamic" and self.stream_pos < self.dataset_size:
            return True  # not all dealt yet
        return bool(self.pending) and self.pending[0] < self.dataset_size  # pending is in stream order

    # ---- assigning uids -----------------------------------------------------------------------

    def start_epoch(self) -> None:
        """The epoch's first uids: the whole static shard, the reader's first, or an even first deal
        of the stream."""
        if self.reader is not None:
            self.reader.start_pass(self.epoch, self.rank, self.world_size)
            self.top_up()
            return
        if self.sharding == "static":
            self._assign(self._static_shard(self.epoch))
            return
        # nothing observed yet: assume a spread of 1 (coefficient of variation of cost)
        per_rank = self.inflight_target
        total = min(self.world_size * per_rank, deal_budget(self.left(), self.world_size, per_rank, spread=1.0))
        if self.mixture is not None:
            total = min(total, self.ready())
        base, extra = divmod(total, self.world_size)
        self.deal([base + (r < extra) for r in range(self.world_size)])

    def next_epoch(self) -> None:
        """The epoch is over (nothing of it pending): count the next one; :meth:`start_epoch` starts it."""
        self.epoch += 1
        if self.mixture is not None:
            self.mixture.next_epoch()

    def deal(self, counts: list[int]) -> None:
        """The next ``sum(counts)`` indices of the shared stream, ``counts[r]`` to rank r in rank order."""
        if self.mixture is not None:  # every rank draws them all alike, and keeps its own
            uids = self.mixture.draw(sum(counts))
            assert len(uids) == sum(counts), f"dealt {sum(counts)} of a mixture that may draw {len(uids)} now"
            # drawn source by source as their levels call: shuffled (seeded, the same on every rank)
            # so that each rank's share holds the sources as the whole does, not a run of one
            order = np.random.default_rng([self.seed, self.epoch, self.stream_pos]).permutation(len(uids))
            uids = [uids[i] for i in order]
            at = sum(counts[:self.rank])
            self._assign(uids[at:at + counts[self.rank]])
            self.stream_pos += len(uids)
            return
        start = self.stream_pos + sum(counts[:self.rank])
        self._assign(self._stream_uids(start, start + counts[self.rank]))
        self.stream_pos += sum(counts)

    def top_up(self) -> None:
        """A reader: what it reads next, while fewer than ``window + lookahead`` are pending. Static
        quota mode: the shard again, in the next epoch's order, while few are pending."""
        if self.reader is not None:
            self._assign(self.reader.read(max(0, self.inflight_target - len(self.pending))))
            return
        if self.sharding != "static" or self.mode != "quota":
            return
        while len(self.pending) < self.inflight_target and self._shard_size():
            self.epoch_of_shard += 1
            self._assign(self._static_shard(self.epoch_of_shard))

    def observe(self, fetched: Sequence[int], admitted: Sequence[SampleCost]) -> None:
        """What this rank fetched and admitted, for a reader that draws by it (:meth:`Reader.observe`)."""
        if self.reader is not None:
            self.reader.observe(fetched, admitted)

    def take(self, count: int) -> list[int]:
        """The next ``count`` pending uids, removed (they are being fetched)."""
        taken = self.pending[:count]
        del self.pending[:count]
        return taken

    def undealt(self) -> list[int]:
        """The uids assigned since the feed was last told, in fetch order (and forgets them)."""
        out, self._undealt = self._undealt, []
        return out

    def _assign(self, uids: list[int]) -> None:
        self.pending.extend(uids)
        self._undealt.extend(uids)

    def _stream_uids(self, start: int, stop: int) -> list[int]:
        """uids at positions [start, stop) of the shared stream (epoch after epoch)."""
        size, out = self.dataset_size, []
        while start < stop:
            epoch, offset = divmod(start, size)
            end = min(stop, (epoch + 1) * size)
            out.extend((self._order(epoch)[offset:offset + end - start] + epoch * size).tolist())
            start = end
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order_cache = epoch_order(self.seed, epoch, self.dataset_size)
            self._order_epoch = epoch
        return self._order_cache

    def _static_shard(self, epoch: int) -> list[int]:
        if self.shards is not None:
            indices = self.shards[self.rank]
        else:
            indices = self._order(epoch)[self.rank::self.world_size].tolist()
        return [epoch * self.dataset_size + int(i) for i in indices]

    def _shard_size(self) -> int:
        if self.shards is not None:
            return len(self.shards[self.rank])
        return len(range(self.rank, self.dataset_size, self.world_size))

    # ---- state (I6) ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This stream's piece of the batcher state (plain ints and lists)."""
        return {"epoch": self.epoch, "stream_pos": self.stream_pos, "pending": list(self.pending),
                "epoch_of_shard": self.epoch_of_shard,
                "reader": self.reader.state_dict() if self.reader is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; every pending uid is told to the feed again, at the next
        round (a fresh feed knows none of them)."""
        self.epoch, self.stream_pos = state["epoch"], state["stream_pos"]
        self.epoch_of_shard = state["epoch_of_shard"]
        self.pending = list(state["pending"])
        self._undealt = list(self.pending)
        if (state.get("reader") is None) != (self.reader is None):
            raise ValueError("the state was taken " + ("with" if state.get("reader") is not None else "without")
                             + " a streaming source and this run is the other way: resume with the same data")
        if self.reader is not None:
            self.reader.load_state_dict(state["reader"])
