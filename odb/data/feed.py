"""From the batcher's dealt uids to processed samples, through a DataLoader and its workers.

:class:`SampleFeed` is the batcher's :class:`odb.batching.batcher.Feed`: the batcher deals uids to
this rank (``deal``), later asks for the next ones in the same order (``fetch``) and tells it
which of them will not train (``forget``). A DataLoader's sampler runs lazily in the main
process, ``prefetch_factor x num_workers`` indices ahead, and would block the very thread that
runs the batcher (and its collective) if it waited for the next deal; and a sampler that ends
ends the epoch. So the
:class:`DealtSampler` never waits and never ends: with nothing dealt it yields ``-1``, which the
workers answer with an empty marker that :meth:`SampleFeed.fetch` skips.

The feed counts what it keeps and what it does not: :attr:`SampleFeed.skipped` (records by skip
reason) and :attr:`SampleFeed.truncated` (``"samples"`` cut to fit the token cap in the workers,
and the ``"tokens"`` cut from them: each sample's ``truncated_tokens``). Both count each fetched
record once; :meth:`SampleFeed.restore` processes records again that were counted before a resume
and counts nothing.
"""

from __future__ import annotations

import signal
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["DealtSampler", "SampleFeed", "DataError"]


class DataError(ValueError):
    """A bad record under ``strict``: the message names its file, line and reason."""


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
    """Runs in the workers. Tensors travel as numpy arrays: pickled bytes are far cheaper than
    torch's shared-memory handles for many small tensors (measured: 4x more samples/s)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, uid: int) -> dict[str, Any] | None:
        if uid < 0:
            return None
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in self.dataset[uid].items()}


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker outlives SIGTERM / SIGUSR1 (SLURM and launchers signal every process of a job): its
    rank stops at a step boundary and saves (odb.training.run.stop.GracefulStop), which needs the
    workers until then; they end when the rank shuts the loader down, or with it."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _to_torch(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in sample.items()}


class SampleFeed:
    """Processed samples by uid, produced by DataLoader workers in dealt order.

    Args:
        dataset: processes a uid into a sample dict.
        cost: a processed sample's sizes for the batcher (:class:`odb.batching.feed.Sizes`:
            tokens, label tokens, patches, and a pair's rejected tokens).
        num_workers / prefetch_factor: the DataLoader's.
    """

    def __init__(self, dataset: Dataset, cost: Callable[[dict], tuple], *,
                 num_workers: int = 0, prefetch_factor: int = 2) -> None:
        self.dataset = dataset
        self.cost = cost
        self.sampler = DealtSampler()
        self.loader = DataLoader(_Processed(dataset), sampler=self.sampler, batch_size=None,
                                 collate_fn=_identity, num_workers=num_workers,
                                 prefetch_factor=prefetch_factor if num_workers else None,
                                 persistent_workers=False, worker_init_fn=_ignore_stop_signals)
        self._iter: Iterator | None = None
        self.store: dict[int, dict[str, Any]] = {}
        self.skipped: Counter[str] = Counter()  # skip reason -> records
        self.truncated: Counter[str] = Counter()  # "samples" cut to the token cap, "tokens" cut from them
        self.examples: list[str] = []  # the first few skipped records, for the log

    def deal(self, uids: list[int]) -> None:
        self.sampler.queue.extend(uids)

    def fetch(self, uids: list[int]) -> list[tuple | None]:
        """The next ``uids`` in dealt order: processed, kept, and their costs returned (``None``
        for a skipped record, counted by reason in :attr:`skipped`).

        Raises:
            DataError: a record was bad under ``strict`` (file, line and reason); the batcher
                stops every rank with it.
        """
        if self._iter is None:
            self._iter = iter(self.loader)
        costs: list[tuple | None] = []
        for uid in uids:
            sample = next(self._iter)
            while sample is None:  # a marker: the sampler had nothing dealt when it was asked
                sample = next(self._iter)
            assert sample["uid"] == uid, f"the feed is out of order: got {sample['uid']}, wanted {uid}"
            costs.append(self._keep(_to_torch(sample)))
        return costs

    def _keep(self, sample: dict[str, Any]) -> tuple | None:
        if "skip" in sample:
            if sample["fatal"]:
                raise DataError(f"{sample['where']}: {sample['detail']} (strict: fix or remove the record, "
                                "or run without --strict to skip and count such records)")
            self.skipped[sample["skip"]] += 1
            if len(self.examples) < 5:
                self.examples.append(f"{sample['where']}: {sample['detail']}")
            return None
        cut = int(sample.get("truncated_tokens", 0))
        if cut:
            self.truncated["samples"] += 1
            self.truncated["tokens"] += cut
        self.store[sample["uid"]] = sample
        return self.cost(sample)

    def restore(self, uids: list[int]) -> None:
        """Processes ``uids`` in this process (a resumed batcher's window), without the loader; they
        were counted when first fetched, so nothing is counted here."""
        for uid in uids:
            self.store[uid] = self.dataset[uid]

    def sizes_of(self, uid: int) -> tuple | None:
        """A held sample's sizes, as :meth:`fetch` returns them; None
        (counted, and freed) where processing it again skipped it (a resume that cuts it shorter,
        to no label)."""
        sample = self.store[uid]
        if "skip" not in sample:
            return self.cost(sample)
        del self.store[uid]
        self.skipped[sample["skip"]] += 1
        return None

    def forget(self, uids: list[int]) -> None:
        """Samples that will not be trained (the batcher dropped them): free them."""
        for uid in uids:
            self.store.pop(uid, None)

    def take(self, uid: int) -> dict[str, Any]:
        return self.store.pop(uid)

    def close(self) -> None:
        self._iter = None  # shuts the workers down
