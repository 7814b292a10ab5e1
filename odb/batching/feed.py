"""The batcher's door to the data (:class:`Feed`), as :class:`odb.batching.align.Communicator` is
its door to the other ranks: it deals uids, fetches their processed sizes and forgets the ones that
will not train. :class:`odb.data.feed.SampleFeed` is the DataLoader's; the simulations' feeds are
plain lists (:mod:`odb.batching.simulate`)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Feed"]


class Feed(Protocol):
    """Where the uids go and the processed samples come from (e.g. :class:`odb.data.feed.SampleFeed`)."""

    def deal(self, uids: list[int]) -> None:
        """These uids will be fetched, after all dealt before them, in this order: start on them."""

    def fetch(self, uids: list[int]) -> list[tuple | None]:
        """The next dealt ``uids``, processed: ``(tokens, label_tokens, patches)`` each, in order, or
        ``None`` for a record the data layer skipped. An exception stops every rank, with it.

        ``label_tokens``: the positions after the first whose label is not -100. A feed that hands
        samples over the cap uncut (the batcher cuts them, over_cap 'truncate') and whose samples
        have prompts adds their labels, ``(tokens, label_tokens, patches, labels)``: the label
        tokens of the prefix a cut sample keeps are counted from them (without them such a
        sample stops the run, :meth:`odb.batching.cost.CostModel.measure`)."""

    def forget(self, uids: list[int]) -> None:
        """Fetched uids that will not be trained (skipped, or dropped over the cap)."""
