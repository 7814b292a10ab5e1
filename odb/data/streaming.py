"""Streaming sources (``--streaming``): JSONL and Parquet shards read front to back, never indexed.

A source too big to index, or one that arrives as many shards, is read as a stream. Each pass over
the data deals the shards to the ranks in a seeded order (rank r reads shards r, r + W, ... of
the pass's permutation, :meth:`StreamShards.pass_order`), each rank scans its own shards front to
back in its own process (:class:`ShardReader`: a JSONL shard a few MiB read at a time, a Parquet
shard's rows counted from its footer, :mod:`odb.data.row_groups`), and a shuffle buffer of
``shuffle_buffer`` records mixes what it hands the batcher. A record's uid says where it is,
``pass * len(shards) + shard * stride + offset`` (``offset``: the byte its line starts at in a JSONL
shard, its row in a Parquet one; ``stride``: the largest shard's size in those units + 1), so a
DataLoader worker reads exactly its record, a JSONL line with one ``pread``, a Parquet row from
its one row group, and a resumed run reads the records it held again by the same offsets.

What odb guarantees for a streaming source, and what it does not:

* Exact-once per pass: every non-blank line and every row of every shard is trained (or skipped
  and counted) exactly once per pass, since each shard is read whole by one rank.
* No random access: the order is the shards' seeded order, mixed only within the buffer, so
  records near each other in a shard train near each other in time; there is no held-out split
  (``--val_ratio``) and no ``--max_samples``; validation data comes from ``--eval_data``.
* Uneven shards end a pass unevenly: a rank whose shards run out first joins the others' steps
  with zero-weight passes until they finish (as any static shard does).
* Resume by shard and offset: the batcher's state holds each rank's shards still to read, the
  offset its current shard is read to, and its buffer; a resume on another number of ranks
  deals those partly read shards and buffers to the new ranks whole.
* The shards are fixed at start: their names, sizes and a digest of their first and last 4 KiB
  (a Parquet file's footer among them) are the data's fingerprint, which a resume checks. A file
  added later is not read.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections import OrderedDict
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from odb.data.row_groups import CACHED_GROUPS, RowGroups
from odb.data.sources import RawRecord, parse_line

__all__ = ["SUFFIXES", "ShardReader", "StreamShards"]

SUFFIXES = (".jsonl", ".parquet")
"""The shards a streaming source reads."""

_EDGE = 1 << 16  # bytes of each window the estimate of records reads
_FINGERPRINT = 1 << 12  # bytes of each end of a shard the fingerprint hashes
_HANDLES = 64  # shard files a process keeps open at most (the least recently read is closed)
_MASK = (1 << 64) - 1


class StreamShards:
    """The shards of ``path`` (a ``.jsonl`` or ``.parquet`` file, or a folder searched for them),
    fixed at start.

    ``len()`` is the uid space of one pass (``shards x stride``), not a record count: a JSONL
    shard's records are counted only as they are read. ``sizes`` are the shards' offset spaces
    (a JSONL shard's bytes, a Parquet shard's rows).
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"streaming data path {path} does not exist; pass a .jsonl or .parquet file, or "
                                    "a folder of them")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        other = sorted({p.suffix or p.name for p in files if p.suffix not in SUFFIXES} - {".lock", ".npy"})
        files = [p for p in files if p.suffix in SUFFIXES]
        if not files:
            raise FileNotFoundError(f"no .jsonl or .parquet shards under {path}: a streaming source reads JSONL and "
                                    f"Parquet shards (found {', '.join(other) or 'nothing'}); drop --streaming to "
                                    "read JSON or save_to_disk data, which odb memory-maps")
        if other and path.is_dir():
            raise ValueError(f"{path} holds {', '.join(other)} files beside its shards; a streaming source reads "
                             ".jsonl and .parquet shards only: move them out, or point --data at the shards' own "
                             "folder")
        self.files = files
        self.file_bytes = [p.stat().st_size for p in files]
        self.row_groups: list[RowGroups | None] = [RowGroups(p) if p.suffix == ".parquet" else None for p in files]
        self.sizes = [len(rows) if rows is not None else size for rows, size in zip(self.row_groups, self.file_bytes)]
        if not any(self.sizes):
            raise ValueError(f"the streaming data {path} holds no records: its {len(files)} shard(s) are empty")
        self.stride = max(self.sizes) + 1
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._groups: OrderedDict[tuple[int, int], Any] = OrderedDict()  # (shard, row group): decoded
        self._pid = 0

    def __len__(self) -> int:
        return len(self.files) * self.stride

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _handles=OrderedDict(), _groups=OrderedDict(), _pid=0)  # a worker opens its own

    def is_parquet(self, shard: int) -> bool:
        return self.row_groups[shard] is not None

    def largest_row_group(self) -> tuple[int, int]:
        """``(rows, decoded bytes)`` of the largest row group of the Parquet shards (0, 0: none)."""
        groups = [g for g in self.row_groups if g is not None]
        return max((g.largest_rows for g in groups), default=0), max((g.largest_bytes for g in groups), default=0)

    def fingerprint(self) -> str:
        """A short hash of the shards: each one's name, size and first and last 4 KiB."""
        digest = hashlib.sha256()
        for shard, (file, size) in enumerate(zip(self.files, self.file_bytes)):
            digest.update(f"{file.name}:{size};".encode())
            with open(file, "rb", buffering=0) as handle:
                digest.update(os.pread(handle.fileno(), min(size, _FINGERPRINT), 0))
                digest.update(os.pread(handle.fileno(), min(size, _FINGERPRINT), max(0, size - _FINGERPRINT)))
        return digest.hexdigest()[:16]

    def estimate_records(self, *, exact_bytes: int = 1 << 24, windows: int = 512) -> int:
        """Records in one pass, as the learning-rate schedule plans them (the same on every rank):
        a Parquet shard's rows, from its footer; every line of the JSONL shards counted when they
        hold at most ``exact_bytes`` in all; else their total size times the records a byte in
        ``windows`` windows of 64 KiB spread evenly over their bytes (line ends a byte, less the
        blank lines seen whole: right for lines of any length)."""
        rows = sum(size for shard, size in enumerate(self.sizes) if self.is_parquet(shard))
        lines = [shard for shard in range(len(self.files)) if not self.is_parquet(shard)]
        sizes = [self.sizes[shard] for shard in lines]
        total = sum(sizes)
        if total <= exact_bytes:
            return max(1, rows + sum(_records_in(self.read_bytes(shard, 0, self.sizes[shard]), starts=True, ends=True)
                                     for shard in lines))
        starts = list(accumulate(sizes, initial=0))
        records = sampled = 0
        for number in range(windows):
            at = number * (total - 1) // max(1, windows - 1)
            which = bisect.bisect_right(starts, at) - 1
            shard, offset = lines[which], at - starts[which]
            window = self.read_bytes(shard, offset, _EDGE)
            records += _records_in(window, starts=offset == 0, ends=offset + len(window) == self.sizes[shard])
            sampled += len(window)
        return max(1, rows + round(total * records / sampled))

    def pass_order(self, seed: int, pass_index: int) -> list[int]:
        """The shards of one pass in their seeded order (the same on every rank)."""
        return np.random.default_rng([seed, pass_index, 1]).permutation(len(self.files)).tolist()

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, byte offset)`` of a record's index (its uid within a pass)."""
        return divmod(index, self.stride)

    def read_bytes(self, shard: int, offset: int, count: int) -> bytes:
        """Up to ``count`` bytes of a JSONL shard from ``offset`` (never past its size at start)."""
        count = max(0, min(count, self.file_bytes[shard] - offset))
        return os.pread(self._fileno(shard), count, offset) if count else b""

    def get(self, index: int) -> RawRecord:
        """The record at the offset ``index`` names: the JSONL line that starts at that byte, or
        that row of a Parquet shard."""
        shard, offset = self.locate(index)
        if not (0 <= shard < len(self.files) and 0 <= offset < self.sizes[shard]):
            raise IndexError(f"record {index} is outside the {len(self.files)} shards")
        if self.is_parquet(shard):
            return RawRecord(self._row(shard, offset), f"{self.files[shard]}:{offset + 1}")
        line, size = b"", 1 << 13
        while True:  # read until the line's end, twice as much each time (a record may be long)
            chunk = self.read_bytes(shard, offset + len(line), size)
            end = chunk.find(b"\n")
            line += chunk if end < 0 else chunk[:end]
            if end >= 0 or len(chunk) < size:
                break
            size *= 2
        return parse_line(line, f"{self.files[shard]}:byte {offset}")

    def _row(self, shard: int, row: int) -> dict[str, Any]:
        """Row ``row`` of a Parquet shard, from its row group (decoded now, or kept from before)."""
        groups = self.row_groups[shard]
        assert groups is not None, f"shard {shard} is JSONL"
        group = groups.group_of(row)
        handle = self._handle(shard)  # (first: a forked worker starts its own handles and groups)
        table = self._groups.get((shard, group))
        if table is None:
            if len(self._groups) >= CACHED_GROUPS:
                self._groups.popitem(last=False)
            table = self._groups[(shard, group)] = groups.read(handle, group)
        self._groups.move_to_end((shard, group))
        return groups.value(table, group, row)

    def _fileno(self, shard: int) -> int:
        return self._handle(shard).fileno()

    def _handle(self, shard: int) -> Any:
        """This process's open file of ``shard`` (a raw file, or a ``ParquetFile``)."""
        if self._pid != os.getpid():  # a forked worker: handles of its own (the parent's stay the parent's)
            self._handles, self._groups, self._pid = OrderedDict(), OrderedDict(), os.getpid()
        handle = self._handles.get(shard)
        if handle is None:
            if len(self._handles) >= _HANDLES:
                self._handles.popitem(last=False)[1].close()
            groups = self.row_groups[shard]
            handle = groups.open() if groups is not None else open(self.files[shard], "rb", buffering=0)
            self._handles[shard] = handle
        self._handles.move_to_end(shard)
        return handle


class ShardReader:
    """One rank's reader (:class:`odb.batching.stream.Reader`): its shards of a pass, front to back,
    through a seeded shuffle buffer, as uids.

    The state (:meth:`state_dict`, the layout :func:`odb.batching.redeal.redeal_readers` deals to
    another number of ranks): ``pass``; ``segments``, the shards still to read as ``[shard, offset]``
    (a byte, or a Parquet shard's row; the first one partly read when its offset is not 0);
    ``buffer``, the uids read and not handed out yet; ``draws``, how many the buffer has handed out
    this pass (it seeds the next pick).

    Args:
        shards: the stream's shards.
        seed: the run's seed (the shards' order per pass and the buffer's picks).
        buffer_size: records the shuffle buffer holds; 1 reads the shards in order.
        chunk_bytes: bytes read at a time while scanning a shard for lines.
    """

    def __init__(self, shards: StreamShards, *, seed: int, buffer_size: int, chunk_bytes: int = 1 << 22) -> None:
        if buffer_size < 1:
            raise ValueError(f"the shuffle buffer needs room for at least one record, got {buffer_size}")
        self.shards, self.seed, self.buffer_size, self.chunk_bytes = shards, seed, buffer_size, chunk_bytes
        self.pass_index, self.draws = 0, 0
        self.segments: list[list[int]] = []
        self.buffer: list[int] = []
        self._chunk, self._chunk_at = b"", (-1, 0)  # the bytes last read, and (shard, offset) they start at

    @property
    def is_done(self) -> bool:
        """Whether every record of this rank's shards of the pass has been handed out."""
        return not self.segments and not self.buffer

    def start_pass(self, pass_index: int, rank: int, world_size: int) -> None:
        """This rank's shards of pass ``pass_index``: every ``world_size``-th of the pass's order."""
        order = self.shards.pass_order(self.seed, pass_index)
        self.pass_index, self.draws, self.buffer = pass_index, 0, []
        self.segments = [[shard, 0] for shard in order[rank::world_size]]

    def read(self, count: int) -> list[int]:
        """Up to ``count`` uids, fewer only once this rank's shards of the pass are all handed out."""
        out: list[int] = []
        base = self.pass_index * len(self.shards)
        while len(out) < count:
            if len(self.buffer) < self.buffer_size and self.segments:
                index = self._next_line()
                if index is not None:
                    self.buffer.append(base + index)
                continue
            if not self.buffer:
                break
            pick = _mix(self.seed, self.pass_index, self.draws) % len(self.buffer)
            self.draws += 1
            self.buffer[pick], self.buffer[-1] = self.buffer[-1], self.buffer[pick]
            out.append(self.buffer.pop())
        return out

    def _next_line(self) -> int | None:
        """The index of the first segment's next record (a non-blank line, or a Parquet shard's next
        row; the segment moves past it), or None when the segment is read to its end (it is then
        dropped)."""
        segment = self.segments[0]
        shard, size = segment[0], self.shards.sizes[segment[0]]
        if self.shards.is_parquet(shard):  # a row is a record: nothing to read
            if segment[1] < size:
                segment[1] += 1
                return shard * self.shards.stride + segment[1] - 1
        else:
            while segment[1] < size:
                offset = segment[1]
                end, blank = self._line(shard, offset, size)
                segment[1] = min(size, end + 1)
                if not blank:
                    return shard * self.shards.stride + offset
        self.segments.pop(0)
        return None

    def _line(self, shard: int, offset: int, size: int) -> tuple[int, bool]:
        """Where the line at ``offset`` ends (its newline, or the shard's end) and whether it is
        blank, from the bytes last read, reading on from ``offset`` when they do not hold it whole."""
        while True:
            grown = 0
            chunk_shard, start = self._chunk_at
            if chunk_shard == shard and start <= offset:
                at = offset - start
                end = self._chunk.find(b"\n", at)
                if end >= 0 or start + len(self._chunk) >= size:
                    stop = end if end >= 0 else len(self._chunk)
                    return start + stop, not self._chunk[at:stop].strip()
                grown = len(self._chunk) - at  # a line longer than what is left: read more at once
            self._chunk = self.shards.read_bytes(shard, offset, max(self.chunk_bytes, 2 * grown))
            self._chunk_at = (shard, offset)

    def observe(self, fetched, admitted) -> None:
        """(One source reads in order, whatever was measured.)"""

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self.pass_index, "segments": [list(s) for s in self.segments], "buffer": list(self.buffer),
                "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pass_index, self.draws = int(state["pass"]), int(state["draws"])
        self.segments = [[int(shard), int(offset)] for shard, offset in state["segments"]]
        self.buffer = [int(u) for u in state["buffer"]]
        self._chunk, self._chunk_at = b"", (-1, 0)


def _records_in(data: bytes, *, starts: bool, ends: bool) -> int:
    """The records of ``data``, read from a shard: a record a line end, less the blank lines seen
    whole (the first line too when ``data`` ``starts`` at a shard's start), plus the last line
    when ``data`` ``ends`` at the shard's end and that line has no line end."""
    lines = data.split(b"\n")
    whole = lines[:-1] if starts else lines[1:-1]  # lines seen from their start to their end
    blank = sum(1 for line in whole if not line.strip())
    last = 1 if ends and lines[-1].strip() else 0
    return data.count(b"\n") - blank + last


def _mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the buffer's pick, the same on every machine."""
    x = 0
    for value in values:
        x = (x ^ (value & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return x
