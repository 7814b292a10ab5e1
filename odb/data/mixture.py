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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["is_plain_path", "source_words", "MixedDataset", "SourceSpec", "parse_source", "parse_sources"]


class MixedDataset:
    """Named datasets (:class:`odb.data.processing.SampleDataset`, each with its own processing
    settings) end to end: a map-style dataset, as a DataLoader reads one (``len`` and ``[i]``; this
    module stays free of torch, so that the flags are checked before its import).

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


_PER_SOURCE = ("format", "train_on", "truncation", "strict", "system_message", "chat_template_kwargs", "system_prompts",
               "system_prompt_prob", "turn_sampling", "image_folder", "min_pixels", "max_pixels")
"""The processing settings (:class:`odb.data.config.DataConfig`) a source may set for itself."""


@dataclass(frozen=True)
class SourceSpec:
    """One named source of a data mixture: where its records are, its weight (None: no weights, the
    sources are simply laid end to end) and its own processing settings (over ``--data_config``'s)."""

    name: str
    path: str
    weight: float | None = None
    processing: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"a source's name must be letters, digits, '-', '_' or '.', got {self.name!r} (it "
                             "names the source's loss/<name> rows)")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"source {self.name!r} needs a path (a data file or folder)")
        if self.weight is not None and (isinstance(self.weight, bool) or not isinstance(self.weight, (int, float))
                                        or not (self.weight > 0 and math.isfinite(self.weight))):
            raise ValueError(f"source {self.name!r}: weight must be a finite number > 0, got {self.weight!r}")
        unknown = sorted(set(self.processing) - set(_PER_SOURCE))
        if "streaming" in unknown:
            raise ValueError(f"source {self.name!r}: streaming is the run's, for every source at once (--streaming, "
                             "or a recipe's streaming: true, with weighted sources: a streamed mixture)")
        if unknown:
            raise ValueError(f"source {self.name!r}: unknown key(s) {unknown}; a source may set name, path, weight "
                             f"and {', '.join(_PER_SOURCE)}")
        object.__setattr__(self, "processing", dict(self.processing))


def parse_source(value: str | Mapping[str, Any]) -> SourceSpec:
    """A source from ``NAME=PATH``, ``NAME=PATH:WEIGHT``, a JSON object (``{"name": ..., "path":
    ..., "weight": ..., "train_on": ...}``) or a mapping (a recipe's list item)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"--data {value!r} is not a JSON object ({err})") from None
    if isinstance(value, Mapping):
        keys = dict(value)
        if "name" not in keys or "path" not in keys:
            raise ValueError(f"a data source needs a name and a path, got {sorted(keys)}")
        name, path, weight = keys.pop("name"), keys.pop("path"), keys.pop("weight", None)
        return SourceSpec(str(name), str(path), weight, keys)
    name, sep, rest = str(value).partition("=")
    if not sep:
        raise ValueError(f"--data {value!r}: with several sources each is NAME=PATH or NAME=PATH:WEIGHT "
                         "(e.g. --data chat=data/chat.jsonl:0.3 code=data/code:0.7)")
    path, colon, weight = rest.rpartition(":")
    if colon:
        try:
            return SourceSpec(name, path, float(weight))
        except ValueError as err:
            if "weight" in str(err) or not path:
                raise
    return SourceSpec(name, rest)


def parse_sources(values: Sequence[str | Mapping[str, Any]]) -> tuple[SourceSpec, ...]:
    """Several sources (:func:`parse_source`): distinct names, and weights on all or on none."""
    sources = tuple(parse_source(v) for v in values)
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"data sources need distinct names, got {names}")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ValueError("give every data source a weight, or none (then they are laid end to end): "
                         + ", ".join(f"{s.name}={s.weight}" for s in sources))
    return sources


def source_words(values: str | Path | list[str]) -> list[str]:
    """The words of a ``--data`` / ``--eval_data`` value (one path, or named sources)."""
    return [str(values)] if isinstance(values, (str, Path)) else [str(v) for v in values]


def is_plain_path(words: list[str]) -> bool:
    """Whether ``--data``'s words are one plain path (an existing one even with '=' in it), not
    named sources."""
    word = words[0]
    return len(words) == 1 and not word.lstrip().startswith("{") and ("=" not in word or Path(word).exists())
