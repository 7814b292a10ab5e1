"""From the batcher's dealt uids to processed samples, through a DataLoader and its workers.

The batcher deals uids to this rank (``on_deal``) and later asks for the next ones in the same
order (``fetch``). A DataLoader's sampler runs lazily in the main process, ``prefetch_factor x
num_workers`` indices ahead, and would block the very thread that runs the batcher (and its
collective) if it waited for the next deal; and a sampler that ends ends the epoch. So the
:class:`DealtSampler` never waits and never ends: with nothing dealt it yields ``-1``, which the
workers answer with an empty marker that :meth:`SampleFeed.fetch` skips.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["DealtSampler", "SampleFeed"]


class DealtSampler(Sampler[int]):
    """Yields the uids dealt so far, in order; ``-1`` while none is waiting. Never ends."""

    def __init__(self) -> None:
        self.queue: deque[int] = deque()

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.queue.popleft() if self.queue else -1


def _identity(sample):
    return sample


class _Processed(Dataset):
    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, uid: int) -> dict[str, Any] | None:
        return None if uid < 0 else self.dataset[uid]


class SampleFeed:
    """Processed samples by uid, produced by DataLoader workers in dealt order.

    Args:
        dataset: processes a uid into a sample dict.
        cost: ``(tokens, label_tokens, patches)`` of a processed sample.
        num_workers / prefetch_factor: the DataLoader's.
    """

    def __init__(self, dataset: Dataset, cost: Callable[[dict], tuple[int, int, int]], *,
                 num_workers: int = 0, prefetch_factor: int = 2) -> None:
        self.dataset = dataset
        self.cost = cost
        self.sampler = DealtSampler()
        self.loader = DataLoader(_Processed(dataset), sampler=self.sampler, batch_size=None,
                                 collate_fn=_identity, num_workers=num_workers,
                                 prefetch_factor=prefetch_factor if num_workers else None,
                                 persistent_workers=False)
        self._iter: Iterator | None = None
        self.store: dict[int, dict[str, Any]] = {}

    def deal(self, uids: list[int]) -> None:
        self.sampler.queue.extend(uids)

    def fetch(self, uids: list[int]) -> list[tuple[int, int, int]]:
        """The next ``uids`` in dealt order: processed, kept, and their costs returned."""
        if self._iter is None:
            self._iter = iter(self.loader)
        for uid in uids:
            sample = next(self._iter)
            while sample is None:  # a marker: the sampler had nothing dealt when it was asked
                sample = next(self._iter)
            assert sample["uid"] == uid, f"the feed is out of order: got {sample['uid']}, wanted {uid}"
            self.store[uid] = sample
        return [self.cost(self.store[uid]) for uid in uids]

    def restore(self, uids: list[int]) -> None:
        """Processes ``uids`` in this process (a resumed batcher's window), without the loader."""
        for uid in uids:
            self.store[uid] = self.dataset[uid]

    def take(self, uid: int) -> dict[str, Any]:
        return self.store.pop(uid)

    def close(self) -> None:
        self._iter = None  # shuts the workers down
