"""Reading an offline W&B run back (tests only)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path


def _records(path: Path) -> Iterator:
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log; wandb 0.31 has no
    public reader for offline runs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buffer = path.read_bytes(), 7, 32768, b""
    while pos < len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            break
        buffer += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buffer)
            buffer = b""
            yield record


def read_wandb_history(path: Path, record_type: str = "history") -> list[dict]:
    """History rows of an offline run, read from its .wandb file; ``record_type="summary"``: its
    summary updates instead, one dict each."""
    rows = []
    for record in _records(path):
        if record.WhichOneof("record_type") == record_type:
            items = record.history.item if record_type == "history" else record.summary.update
            rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def read_wandb_run(path: Path) -> dict:
    """An offline run's id, project and name, as its .wandb file's run record holds them."""
    run = next(record.run for record in _records(path) if record.WhichOneof("record_type") == "run")
    return {"id": run.run_id, "project": run.project, "name": run.display_name}


def offline_runs(out: Path) -> list[Path]:
    """The .wandb file of every offline run under ``out/wandb``, in the order they were started."""
    return [next(run.glob("*.wandb")) for run in sorted((out / "wandb").glob("offline-run-*"))]


def offline_histories(out: Path) -> list[list[dict]]:
    """The history of every offline run under ``out/wandb``, in the order they were started."""
    return [read_wandb_history(path) for path in offline_runs(out)]


def offline_summaries(out: Path) -> list[dict]:
    """What each offline run under ``out/wandb`` set in its summary (its updates merged), in the
    order they were started."""
    merged = []
    for path in offline_runs(out):
        summary: dict = {}
        for update in read_wandb_history(path, record_type="summary"):
            summary.update(update)
        merged.append(summary)
    return merged
