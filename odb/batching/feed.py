"""The batcher's door to the data (:class:`Feed`), as :class:`odb.batching.align.Communicator` is
its door to the other ranks: it deals uids, fetches their processed sizes and forgets the ones that
will not train. :class:`odb.data.feed.SampleFeed` is the DataLoader's; the simulations' feeds are
plain lists (:mod:`odb.batching.simulate`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

__all__ = ["Feed", "Sizes"]


class Sizes(NamedTuple):
    """A processed sample's sizes, as a feed hands them over (:meth:`Feed.fetch`; a plain tuple of
    the first three, or four, does as well)."""

    tokens: int
    label_tokens: int
    patches: int = 0
    labels: Sequence[int] | None = None
    """Its labels (-100 where none), for a sample the batcher may cut (:meth:`Feed.fetch`)."""
    second: int = 0
    """A preference pair (chosen then rejected, end to end): the rejected sequence's tokens, the
    chosen's being ``tokens - second``; 0 for a sample of one sequence
    (:class:`odb.batching.cost.SampleCost`)."""


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
        sample stops the run, :meth:`odb.batching.cost.CostModel.measure`). A sample of two
        sequences (a preference pair) adds the second's tokens after them (``labels`` may be
        None): :class:`Sizes`, whose fields these are."""

    def forget(self, uids: list[int]) -> None:
        """Fetched uids that will not be trained (skipped, or dropped over the cap)."""
