"""Where each record of a JSONL file starts: a small index file, built once and memory-mapped.

An index is one int64 ``.npy`` array, the header first::

    [VERSION, size, mtime_ns, num_records, num_blank, digest (4 words), offsets..., blank_at...]

``offsets[i]`` is the byte offset of record ``i`` (the ``i``-th non-blank line). Line numbers,
for "file:line" in error messages, are not stored per record: a blank line ``k`` stores
``blank_at[k]``, the number of records before it, so record ``i`` is on line
``i + 1 + #{k : blank_at[k] <= i}`` (a ``searchsorted``). A file without blank lines stores none.
``digest`` is the SHA-256 of the file's bytes, computed while indexing, so the data's fingerprint
changes with any edit without reading the file again.

The index is written next to the data (``<file>.odb-index.npy``) or, where that folder is
read-only, under ``cache_dir``, and reused while the file's size and mtime match its header;
otherwise it is rebuilt. Several processes (the ranks of a node, or nodes sharing a filesystem)
may start at once: the first creates ``<index>.lock`` and builds, touching the lock as it goes;
the others print what they wait for and read its index when it appears. A waiter builds the index
itself (written to a temporary file and renamed, so any reader sees a whole index) when the lock
stops being touched for ``STALE_S`` (the lock is then removed: its process is gone) or after
``MAX_WAIT_S``: nobody waits forever, nor silently.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import numpy as np

__all__ = ["SUFFIX", "LineIndex", "build_index", "load_line_index", "read_index"]

VERSION = 0x6F6462_0001  # "odb", format 1
HEADER = 9
SUFFIX = ".odb-index.npy"
CHUNK_BYTES = 1 << 20
STALE_S = 60.0  # a lock not touched for this long belongs to a process that is gone
MAX_WAIT_S = 900.0  # the longest any process waits for another's index before building its own
REPORT_EVERY_S = 30.0
TOUCH_EVERY_S = 5.0
LARGE_BYTES = 1 << 30  # files this large are worth a line on stderr when indexed or kept in memory

_SPACE = np.zeros(256, dtype=bool)  # what bytes.strip() removes
_SPACE[list(b" \t\n\r\x0b\x0c")] = True


class LineIndex:
    """Record offsets and line numbers of one JSONL file (a view of its index array).

    Args:
        array: the index (header, offsets, blank_at), memory-mapped or in memory.
        path: the index file it was read from; None when it is kept in memory only.
    """

    def __init__(self, array: np.ndarray, path: Path | None) -> None:
        array = array.view(np.ndarray)  # the same mapped bytes, without np.memmap's cost at every get
        self.array, self.path = array, path
        self.size, self.num_records, num_blank = (int(v) for v in (array[1], array[3], array[4]))
        self.offsets = array[HEADER:HEADER + self.num_records]
        self.blank_at = array[HEADER + self.num_records:HEADER + self.num_records + num_blank]

    def __len__(self) -> int:
        return self.num_records

    def span(self, record: int) -> tuple[int, int]:
        """``(offset, end)``: record ``record`` is the first line of bytes ``[offset, end)``."""
        end = int(self.offsets[record + 1]) if record + 1 < self.num_records else self.size
        return int(self.offsets[record]), end

    def line(self, record: int) -> int:
        """The 1-based line number of record ``record``."""
        return record + 1 + (int(self.blank_at.searchsorted(record, side="right")) if len(self.blank_at) else 0)

    def identity(self) -> bytes:
        """What the records are, whatever the file's mtime: the record and blank-line counts and
        the digest of the file's bytes (the offsets follow from those bytes)."""
        return self.array[3:HEADER].tobytes()


def load_line_index(file: Path, cache_dir: Path | None = None) -> LineIndex:
    """The index of ``file``: read if one is up to date, else built and written (see the module)."""
    stat = file.stat()
    stamp = (stat.st_size, stat.st_mtime_ns)
    places = [file.with_name(file.name + SUFFIX)]
    if cache_dir is not None:
        key = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
        places.append(Path(cache_dir) / "data_index" / f"{file.name}.{key}{SUFFIX}")
    for place in places:
        if (index := read_index(place, stamp)) is not None:
            return index
    for place in places:
        try:
            return _index_at(place, file, stamp)
        except OSError:  # this folder cannot be written: the next place
            continue
    if stat.st_size >= LARGE_BYTES:
        _say(f"cannot write an index for {file} next to it{' or under ' + str(cache_dir) if cache_dir else ''}: "
             "it is kept in this process's memory (8 bytes a record, built again by every process); make "
             f"{file.parent} writable{'' if cache_dir else ' or pass cache_dir'} to build it once")
    return LineIndex(build_index(file), None)


def read_index(path: Path, stamp: tuple[int, int] | None = None) -> LineIndex | None:
    """The index at ``path``, memory-mapped, or None when it is missing, damaged or (given
    ``stamp``, the data file's ``(size, mtime_ns)``) out of date."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if array.dtype != np.int64 or array.ndim != 1 or len(array) < HEADER or int(array[0]) != VERSION:
        return None
    if len(array) != HEADER + int(array[3]) + int(array[4]):
        return None
    if stamp is not None and (int(array[1]), int(array[2])) != stamp:
        return None
    return LineIndex(array, path)


def _index_at(place: Path, file: Path, stamp: tuple[int, int]) -> LineIndex:
    """Build the index at ``place`` under its lock, or wait for the process that holds the lock.
    Raises OSError when ``place``'s folder cannot be written."""
    place.parent.mkdir(parents=True, exist_ok=True)
    lock = place.with_name(place.name + ".lock")
    waited_since = time.monotonic()
    last_report = -REPORT_EVERY_S
    seen = None  # (the lock's mtime, when we first saw that mtime)
    while True:
        if (index := read_index(place, stamp)) is not None:
            return index
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            now = time.monotonic()
            try:
                mtime = lock.stat().st_mtime_ns
                owner = lock.read_text() or "another process"
            except FileNotFoundError:
                continue  # released just now: read its index, or claim the lock
            if seen is None or seen[0] != mtime:
                seen = (mtime, now)
            if now - seen[1] > STALE_S:  # its process is gone: take the lock over
                _say(f"removing {lock} of {owner}, not touched for {STALE_S:.0f} s: indexing {file} here")
                lock.unlink(missing_ok=True)
                continue
            if now - waited_since > MAX_WAIT_S:  # still touched, but too long: build alongside
                _say(f"waited {MAX_WAIT_S:.0f} s for {owner} to index {file}: indexing it here too")
                return _write(place, build_index(file), file)
            if now - last_report >= REPORT_EVERY_S:
                _say(f"waiting for {owner} to index {file} (lock {lock}, waited {now - waited_since:.0f} s; "
                     f"at most {MAX_WAIT_S:.0f} s, or {STALE_S:.0f} s after the lock stops being touched)")
                last_report = now
            time.sleep(0.2)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} pid {os.getpid()}".encode())
            return _write(place, build_index(file, touch=lock), file)
        finally:
            os.close(fd)
            lock.unlink(missing_ok=True)


def _write(place: Path, array: np.ndarray, file: Path) -> LineIndex:
    """Save ``array`` at ``place`` through a temporary file and an atomic rename, then map it."""
    temporary = place.with_name(f"{place.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as out:
            np.save(out, array, allow_pickle=False)
        os.replace(temporary, place)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        _say(f"could not write {place} ({err}): the index of {file} is kept in this process's memory")
        return LineIndex(array, None)
    return read_index(place) or LineIndex(array, None)


def build_index(file: Path, *, touch: Path | None = None) -> np.ndarray:
    """Index ``file`` in chunks: numpy finds the newlines; only lines that start with white space
    are looked at in Python (to tell blank lines apart). ``touch`` is a lock file to keep fresh.

    A line is a run of bytes ending in ``b"\\n"`` (or at the end of the file), as Python's own
    iteration over a binary file splits it; a blank line is one that ``bytes.strip()`` empties.
    """
    digest = hashlib.sha256()
    offsets, blank_at = _Column(), _Column()
    line_start, line_blank = 0, True  # the line still open at the end of the last chunk
    position = 0
    touched = time.monotonic()
    buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
    with open(file, "rb", buffering=0) as f:
        stat = os.fstat(f.fileno())
        if stat.st_size >= LARGE_BYTES:
            _say(f"indexing {file} ({stat.st_size / 2**30:.1f} GiB) for random access; done once while the "
                 "file is unchanged")
        while size := f.readinto(buffer):
            buf = buffer[:size]
            digest.update(buf)
            newlines = np.flatnonzero(buf == 10)
            if not len(newlines):
                line_blank = line_blank and _all_space(buf)
            else:
                # piece k runs from starts[k] to newlines[k] (inclusive); piece 0 ends the open line
                starts = np.concatenate(([0], newlines[:-1] + 1))
                blank = _SPACE[buf[starts]]
                for k in np.flatnonzero(blank):  # only lines that start with white space
                    blank[k] = _all_space(buf[starts[k]:newlines[k] + 1])
                blank[0] = line_blank and blank[0]
                keep = ~blank
                line_starts = starts + position
                line_starts[0] = line_start
                blank_at.extend((offsets.size + np.cumsum(keep) - keep)[blank])
                offsets.extend(line_starts[keep])
                line_start = position + int(newlines[-1]) + 1
                line_blank = _all_space(buf[newlines[-1] + 1:])
            position += size
            if touch is not None and time.monotonic() - touched > TOUCH_EVERY_S:
                os.utime(touch)
                touched = time.monotonic()
    if not line_blank:  # a last line without a newline
        offsets.extend(np.array([line_start]))
    words = np.frombuffer(digest.digest(), dtype=np.int64)
    header = np.array([VERSION, stat.st_size, stat.st_mtime_ns, offsets.size, blank_at.size], np.int64)
    return np.concatenate([header, words, offsets.values(), blank_at.values()])


class _Column:
    """An int64 column appended to in place. Its storage doubles, from 32 MiB (virtual until
    written): allocations that large are mapped apart and go back to the system when freed, where
    a list of per-chunk pieces would stay in the allocator's heap (measured: 80 MB at 10M records)."""

    def __init__(self) -> None:
        self.data, self.size = np.empty(4 << 20, dtype=np.int64), 0

    def extend(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self.data):
            grown = np.empty(max(2 * len(self.data), end), dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:end] = values
        self.size = end

    def values(self) -> np.ndarray:
        return self.data[:self.size]


def _all_space(piece: np.ndarray) -> bool:
    return not len(piece) or (bool(_SPACE[piece[0]]) and piece.tobytes().isspace())


def _say(message: str) -> None:
    print(f"odb: {message}", file=sys.stderr, flush=True)
