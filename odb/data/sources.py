"""Local data files as indexed records: JSONL, JSON and Parquet, or folders of them.

JSONL is indexed by line offsets and each line is parsed when its sample is processed (in a
DataLoader worker), so one bad line is one skipped sample, reported with its file and line,
not a failed epoch. JSON arrays are parsed at start; Parquet is read with Hugging Face
``datasets`` (memory-mapped Arrow, local files only).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RawRecord", "Source"]

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class RawRecord:
    value: dict[str, Any] | None  # None when the record could not be read
    where: str  # "file:line" (JSONL, JSON) or "file:row" (Parquet)
    error: str | None = None  # a skip reason when value is None


class Source:
    """All records of ``path`` (a file, or a folder searched for .jsonl/.json/.parquet files)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"data path {path} does not exist; pass --data data/chat.jsonl, a "
                                    ".json/.parquet file or a folder of them")
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no {'/'.join(SUFFIXES)} files under {path}")
        self.parts: list[tuple[Path, Any, int]] = []  # (file, reader, records)
        for file in files:
            reader = self._open(file)
            self.parts.append((file, reader, len(reader)))
        self.starts = [0]
        for _, _, n in self.parts:
            self.starts.append(self.starts[-1] + n)
        if self.starts[-1] == 0:
            raise ValueError(f"data path {path} holds no records")

    @staticmethod
    def _open(file: Path):
        if file.suffix == ".jsonl":
            return _JsonLines(file)
        if file.suffix == ".json":
            try:
                value = json.loads(file.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{file} is not valid JSON ({err}); a JSON file must hold a list of "
                                 "records (use .jsonl for one record per line)") from err
            rows = value.get("data") if isinstance(value, dict) else value
            if not isinstance(rows, list):
                raise ValueError(f"{file} must hold a list of records (or {{'data': [...]}})")
            return rows
        # Parquet through Hugging Face datasets, no hub access
        from datasets import Dataset

        return Dataset.from_parquet(str(file))

    def __len__(self) -> int:
        return self.starts[-1]

    def fingerprint(self) -> str:
        """A short hash of what the records are: each file's name (not its folder: nodes mount data
        at different paths), size in bytes and record count, and a JSONL file's line offsets."""
        digest = hashlib.sha256()
        for file, reader, count in self.parts:
            digest.update(f"{file.name}:{file.stat().st_size}:{count};".encode())
            if isinstance(reader, _JsonLines):
                digest.update(json.dumps(reader.offsets).encode())
        return digest.hexdigest()[:16]

    def get(self, index: int) -> RawRecord:
        part = next(i for i in range(len(self.parts)) if index < self.starts[i + 1])
        file, reader, _ = self.parts[part]
        local = index - self.starts[part]
        if isinstance(reader, _JsonLines):
            return reader.get(local)
        value = reader[local]
        where = f"{file}:{local + 1}"
        if not isinstance(value, dict):
            return RawRecord(None, where, "not_an_object")
        return RawRecord(value, where)


class _JsonLines:
    """Byte offsets of the non-blank lines of a JSONL file; lines parsed on access."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.offsets: list[tuple[int, int]] = []  # (byte offset, line number)
        offset = 0
        with open(file, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    self.offsets.append((offset, number))
                offset += len(line)

    def __len__(self) -> int:
        return len(self.offsets)

    def get(self, local: int) -> RawRecord:
        offset, number = self.offsets[local]
        with open(self.file, "rb") as f:
            f.seek(offset)
            line = f.readline()
        where = f"{self.file}:{number}"
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return RawRecord(None, where, "not_json")
        if not isinstance(value, dict):
            return RawRecord(None, where, "not_an_object")
        return RawRecord(value, where)
