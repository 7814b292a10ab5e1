"""Several named sources as one dataset: what a data mixture trains from.

:class:`MixedDataset` lays its sources end to end: dataset index ``i`` is record ``i - start[s]``
of source ``s``. Which records an epoch trains, and how often (the weights, the unit they are
counted in), is the batcher's business (:mod:`odb.batching.mixture`); a uid is ``pass *
len(dataset) + index``, where ``pass`` counts the passes over that record's own source, so a
record repeated by up-sampling keeps a uid of its own (and augmentation seeded by it).

Every sample (and every skipped record) carries ``source``, the position of its source in
:attr:`MixedDataset.source_names`; ``index`` is the dataset index and ``where`` the record's own
``file:line``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

__all__ = ["MixedDataset"]


class MixedDataset(Dataset):
    """Named datasets (:class:`odb.data.processing.SampleDataset`, each with its own processing
    settings) end to end.

    Args:
        parts: ``(name, dataset)`` per source, names distinct.
    """

    def __init__(self, parts: Sequence[tuple[str, Any]]) -> None:
        names = [name for name, _ in parts]
        if not parts or len(set(names)) != len(names):
            raise ValueError(f"a mixture needs at least one source and distinct names, got {names}")
        self.source_names: tuple[str, ...] = tuple(names)
        self.parts = [dataset for _, dataset in parts]
        self.starts = [0]
        for dataset in self.parts:
            self.starts.append(self.starts[-1] + len(dataset))
        self.vision = self.parts[0].vision

    @property
    def sizes(self) -> list[int]:
        """Records per source."""
        return [len(dataset) for dataset in self.parts]

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, record)`` of a dataset index."""
        source = bisect.bisect_right(self.starts, index) - 1
        return source, index - self.starts[source]

    def fingerprint(self) -> str:
        """A short hash of the sources' names and records."""
        value = [[name, dataset.fingerprint()] for name, dataset in zip(self.source_names, self.parts)]
        return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]

    def __getitem__(self, uid: int) -> dict[str, Any]:
        size = len(self)
        index = uid % size
        source, record = self.locate(index)
        part = self.parts[source]
        sample = part[(uid // size) * len(part) + record]  # the source's own uid: its pass and record
        sample.update(uid=uid, index=index, source=source)
        return sample
