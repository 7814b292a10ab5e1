"""Local data as indexed records: JSONL, JSON, Parquet and ``datasets.save_to_disk`` folders, or
folders of them.

JSONL is indexed by line offsets (:mod:`odb.data.index`: one int64 array, memory-mapped from a
small file built once and shared by every process that reads the data) and each line is read
through the process's own open file and parsed when its sample is processed (in a DataLoader
worker), so one bad line is one skipped sample, reported with its file and line, not a failed
epoch. JSON arrays are parsed at start (they are meant to be small).

Parquet files and ``save_to_disk`` folders are read as memory-mapped Arrow through Hugging Face
``datasets`` (local files only): ``load_from_disk`` maps a saved folder as it is, and
``Dataset.from_parquet`` converts a Parquet file once into ``datasets``' cache (under its lock;
later ranks and runs map the same conversion). Reading Parquet by row group instead would copy
nothing, but training reads records in random order and Parquet cannot seek to a row inside a
row group: every miss decodes a whole group (about 100 ms for 250,000 chat rows, see
docs/benchmarks.md), or each worker keeps the whole file decoded.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from odb.data.index import LineIndex, load_line_index, read_index

__all__ = ["RawRecord", "Source", "parse_line"]

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class RawRecord:
    value: dict[str, Any] | None  # None when the record could not be read
    where: str  # "file:line" (JSONL, JSON) or "file:row" (Parquet, save_to_disk folders)
    error: str | None = None  # a skip reason when value is None


class Source:
    """All records of ``path``: a file, a ``save_to_disk`` folder, or a folder searched for
    .jsonl/.json/.parquet files and ``save_to_disk`` folders (in path order).

    Args:
        path: the data.
        cache_dir: where a JSONL file's index goes when the data's folder is read-only (e.g. the
            run's output folder); None keeps such an index in memory.
    """

    def __init__(self, path: str | Path, *, cache_dir: str | Path | None = None) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"data path {path} does not exist; pass --data data/chat.jsonl, a "
                                    ".json/.parquet file, a datasets save_to_disk folder or a folder of them")
        found = _find(path)
        if not found:
            raise FileNotFoundError(f"no {'/'.join(SUFFIXES)} files or save_to_disk folders under {path}")
        cache = Path(cache_dir) if cache_dir is not None else None
        self.parts: list[tuple[Path, _JsonLines | _Rows]] = [(part, _open(part, cache)) for part in found]
        self.starts = [0]
        for _, reader in self.parts:
            self.starts.append(self.starts[-1] + len(reader))
        if self.starts[-1] == 0:
            raise ValueError(f"data path {path} holds no records")

    def __len__(self) -> int:
        return self.starts[-1]

    def fingerprint(self) -> str:
        """A short hash of what the records are: each part's name (not its folder: nodes mount data
        at different paths), record count and contents (size and content digest of a JSONL file,
        size of a JSON or Parquet file, ``datasets``' own state of a saved folder)."""
        digest = hashlib.sha256()
        for part, reader in self.parts:
            digest.update(f"{part.name}:{len(reader)};".encode())
            digest.update(reader.identity())
        return digest.hexdigest()[:16]

    def get(self, index: int) -> RawRecord:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of a source of {len(self)}")
        part = bisect.bisect_right(self.starts, index) - 1
        return self.parts[part][1].get(index - self.starts[part])


def parse_line(line: bytes, where: str) -> RawRecord:
    """One JSONL line as a record, or the reason it is none (``not_json``, ``not_an_object``)."""
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return RawRecord(None, where, "not_json")
    if not isinstance(value, dict):
        return RawRecord(None, where, "not_an_object")
    return RawRecord(value, where)


def _find(path: Path) -> list[Path]:
    """The files and saved folders that make up ``path``, sorted."""
    dicts = sorted(p.parent for p in path.rglob("dataset_dict.json")) if path.is_dir() else []
    if dicts:
        names = sorted(p.name for p in dicts[0].iterdir() if _is_saved(p)) or ["train"]
        raise ValueError(f"{dicts[0]} is a datasets DatasetDict (splits {', '.join(names)}): pass one split, "
                         f"e.g. --data {dicts[0] / names[0]}")
    if _is_saved(path) or not path.is_dir():
        return [path]
    saved = {p.parent for p in path.rglob("state.json") if _is_saved(p.parent)}
    files = {p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()
             and not any(folder in p.parents for folder in saved)}
    return sorted(saved | files)


def _is_saved(folder: Path) -> bool:
    """Whether ``folder`` was written by ``datasets.Dataset.save_to_disk``."""
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def _open(part: Path, cache_dir: Path | None) -> _JsonLines | _Rows:
    if part.is_dir():
        from datasets import load_from_disk

        return _Rows(load_from_disk(str(part)), part, (part / "state.json").read_bytes())
    if part.suffix == ".jsonl":
        return _JsonLines(part, cache_dir)
    size = str(part.stat().st_size).encode()
    if part.suffix == ".json":
        try:
            value = json.loads(part.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{part} is not valid JSON ({err}); a JSON file must hold a list of "
                             "records (use .jsonl for one record per line)") from err
        rows = value.get("data") if isinstance(value, dict) else value
        if not isinstance(rows, list):
            raise ValueError(f"{part} must hold a list of records (or {{'data': [...]}})")
        return _Rows(rows, part, size)
    from datasets import Dataset  # Parquet: converted once into datasets' cache, no hub access

    return _Rows(Dataset.from_parquet(str(part)), part, size)


class _Rows:
    """Records already in a sequence: a parsed JSON array or a memory-mapped ``datasets.Dataset``."""

    def __init__(self, rows: Any, part: Path, identity: bytes) -> None:
        self.rows, self.part, self._identity = rows, part, identity

    def __len__(self) -> int:
        return len(self.rows)

    def identity(self) -> bytes:
        return self._identity

    def get(self, local: int) -> RawRecord:
        value = self.rows[local]
        where = f"{self.part}:{local + 1}"
        if not isinstance(value, dict):
            return RawRecord(None, where, "not_an_object")
        return RawRecord(value, where)


class _JsonLines:
    """The non-blank lines of a JSONL file, read through an index and parsed on access.

    Each process reads through a file handle of its own, opened on first use: a DataLoader worker
    forked from its rank opens its own (``os.getpid()`` tells), and a pickled copy (a spawned
    worker) carries neither the handle nor the memory-mapped index, only the index's path.
    """

    def __init__(self, file: Path, cache_dir: Path | None) -> None:
        self.file = file
        self.index: LineIndex | None = load_line_index(file, cache_dir)
        self.index_path = self.index.path
        self.num_records = len(self.index)
        self.size, self.contents = self.index.size, self.index.identity()
        self._handle: Any = None
        self._pid = 0

    def __len__(self) -> int:
        return self.num_records

    def identity(self) -> bytes:
        return str(self.size).encode() + self.contents

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__, _handle=None, _pid=0)
        if self.index_path is not None:  # mapped again where it is unpickled
            state["index"] = None
        return state

    def get(self, local: int) -> RawRecord:
        index = self.index if self.index is not None else self._map()
        offset, end = index.span(local)
        line = os.pread(self._fileno(), end - offset, offset).partition(b"\n")[0]
        return parse_line(line, f"{self.file}:{index.line(local)}")

    def _fileno(self) -> int:
        if self._handle is None or self._pid != os.getpid():
            self._handle = open(self.file, "rb", buffering=0)  # kept open for every get
            self._pid = os.getpid()
        return self._handle.fileno()

    def _map(self) -> LineIndex:
        assert self.index_path is not None, "an index kept in memory travels with the pickle"
        self.index = read_index(self.index_path)
        if self.index is None or self.index.identity() != self.contents:
            raise ValueError(f"the index {self.index_path} of {self.file} changed or went away while odb "
                             "was reading the file (was the file rewritten?); restart the run")
        return self.index
