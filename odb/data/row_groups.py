"""A Parquet shard of a streaming source: its rows counted from the footer, read one row group at a time.

A streaming source's reader (:class:`odb.data.streaming.ShardReader`) needs only each shard's row
count, which the file's footer holds: scanning a Parquet shard reads no row. A DataLoader worker
reads a record by decoding the one row group that holds it (:meth:`RowGroups.read`, through the
process's own open file) and keeps the last ``CACHED_GROUPS`` groups it decoded: the shuffle
buffer hands out rows read near each other, so most records are in a group decoded already. A
file is never read whole, unless it is one row group (write shards with ``row_group_size``).
A record's offset within its shard is its row.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

__all__ = ["CACHED_GROUPS", "RowGroups"]

CACHED_GROUPS = 2
"""Decoded row groups a process keeps (over all shards); the least recently read goes first."""


class RowGroups:
    """The row groups of one Parquet shard, from its footer (no row is read here)."""

    def __init__(self, file: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            metadata = pq.read_metadata(file)
        except (OSError, pa.ArrowInvalid) as err:
            raise ValueError(f"{file} is not a readable Parquet file ({err}); rewrite it, or move it out of the "
                             "streaming data") from None
        groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
        self.file = file
        self.starts = [0]
        for group in groups:
            self.starts.append(self.starts[-1] + group.num_rows)
        self.largest_rows = max((g.num_rows for g in groups), default=0)
        self.largest_bytes = max((g.total_byte_size for g in groups), default=0)  # decoded (uncompressed)

    def __len__(self) -> int:
        return self.starts[-1]

    def group_of(self, row: int) -> int:
        """The row group that holds ``row``."""
        return bisect.bisect_right(self.starts, row) - 1

    def read(self, handle: Any, group: int):
        """Row group ``group`` decoded (a ``pyarrow.Table``), through ``handle`` (:meth:`open`'s)."""
        return handle.read_row_group(group)

    def open(self) -> Any:
        """A handle of this process's own on the file (a ``pyarrow.parquet.ParquetFile``)."""
        import pyarrow.parquet as pq

        return pq.ParquetFile(self.file, memory_map=False)

    def value(self, table, group: int, row: int) -> dict[str, Any]:
        """Row ``row`` of the shard, from its decoded group ``table``."""
        return table.slice(row - self.starts[group], 1).to_pylist()[0]
