"""A streaming source through launch/train.py (ZeRO-2, the tiny model, the bundled data cut into
five uneven JSONL shards with blank lines, or five Parquet shards of row groups of 4 rows): 2
passes on 2 ranks, stopped mid-pass and resumed on 3 ranks. The oracle is the shards split into
lines by Python (a Parquet shard: read whole by pyarrow): every record trains exactly once per
pass over the two runs together (audit ids: ``shard * stride + offset``, a byte or a row), ranks
stay aligned, and the learning-rate schedule plans the counted records."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launch import ROOT, audit, deepspeed, ds_config, odb_config
from odb.data.streaming import StreamShards

SHARDS = [7, 25, 3, 14, 11]  # records per shard: 60 in all


def records(shards: StreamShards) -> Counter:
    """(shard, offset) of every record: a non-blank line's byte, from the files as Python splits
    them, or a Parquet row, from the table pyarrow reads whole."""
    out = Counter()
    for shard, file in enumerate(shards.files):
        if file.suffix == ".parquet":
            out.update((shard, row) for row in range(len(pq.read_table(file))))
            continue
        offset = 0
        for line in file.read_bytes().splitlines(keepends=True):
            if line.strip():
                out[(shard, offset)] += 1
            offset += len(line)
    return out


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_two_passes_stopped_and_resumed_on_three_ranks_train_every_record_once_a_pass(tmp_path, kind):
    chat = (ROOT / "data" / "chat.jsonl").read_text().splitlines()
    folder, start = tmp_path / "shards", 0
    folder.mkdir()
    for number, count in enumerate(SHARDS):
        lines = chat[start:start + count]
        start += count
        if kind == "parquet":
            rows = pa.Table.from_pylist([json.loads(line) for line in lines])
            pq.write_table(rows, folder / f"train-{number:05d}.parquet", row_group_size=4)
        else:
            (folder / f"train-{number:05d}.jsonl").write_text("\n\n".join(lines) + "\n")
    shards = StreamShards(folder)
    assert shards.estimate_records() == sum(SHARDS)  # up to 16 MiB in all every line is counted; every row
    out = tmp_path / "run"
    args = ["--deepspeed_config", str(ds_config(tmp_path, 2)),
            "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=4, lookahead=2, gas=2)),
            "--data", str(folder), "--streaming", "--shuffle_buffer", "6", "--epochs", "2",
            "--output_dir", str(out), "--audit_ids", "--preflight", "off", "--num_workers", "1"]
    first = deepspeed([*args, "--max_steps", "2", "--save_steps", "2", "--no_final_checkpoint"])
    assert "streaming 5 shard(s)" in first.stdout and "about 60 records a pass" in first.stdout
    before = audit(out, 2)
    readers = [json.loads(path.read_text())["reader"] for path in sorted(out.rglob("odb_state.rank*.json"))]
    assert len(readers) == 2 and readers[0]["pass"] == 0
    assert any(r["buffer"] or any(offset for _, offset in r["segments"]) for r in readers), "saved between passes"
    for rank in range(2):
        (out / f"emitted_ids.rank{rank}.jsonl").rename(out / f"first.rank{rank}.jsonl")
    resumed = deepspeed([*args, "--resume"], nproc=3)
    assert "resumed from" in resumed.stdout
    after = audit(out, 3)
    for rows in (before, after):  # every rank ran the same steps and micro-batches
        assert len({tuple((r["step"], r["micro"]) for r in rank) for rank in rows}) == 1
    trained = Counter()
    for row in [r for rank in before + after for r in rank]:
        for index, epoch in zip(row["ids"], row["epochs"]):
            trained[(epoch, *shards.locate(index))] += 1
    expected = Counter({(epoch, *key): 1 for epoch in range(2) for key in records(shards)})
    assert trained == expected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["dataset_samples"] is None
    print(f"{len(before[0])} + {len(after[0])} audit rows per rank; {sum(trained.values())} samples over 2 passes, "
          f"each of the {sum(SHARDS)} records once a pass")


def test_a_streamed_mixture_trains_each_record_and_resumes_on_the_same_ranks(tmp_path):
    """Two weighted streaming sources (JSONL shards a: 0.3, Parquet shards b: 0.7, mix_epoch all):
    stopped after 3 steps and resumed on the same 2 ranks. The oracle is the shards: every record of
    both sources trains, its first pass exactly once (b, the lighter by its pass level, again in
    repeats), ranks stay aligned over both runs, and the trained shares of label tokens are the
    weights within a record per rank (summary.json's sources)."""
    chat = (ROOT / "data" / "chat.jsonl").read_text().splitlines()
    folders = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for folder in folders.values():
        folder.mkdir()
    for number in range(4):
        (folders["a"] / f"s{number}.jsonl").write_text("\n".join(chat[10 * number:10 * number + 10]) + "\n")
    for number in range(2):
        rows = [json.loads(line) for line in chat[40 + 10 * number:50 + 10 * number]]
        pq.write_table(pa.Table.from_pylist(rows), folders["b"] / f"s{number}.parquet", row_group_size=4)
    shards = {name: StreamShards(folder) for name, folder in folders.items()}
    out = tmp_path / "run"
    args = ["--deepspeed_config", str(ds_config(tmp_path, 2)),
            "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=4, lookahead=2, gas=2)),
            "--data", f"a={folders['a']}:0.3", f"b={folders['b']}:0.7", "--streaming", "--shuffle_buffer", "6",
            "--output_dir", str(out), "--audit_ids", "--preflight", "off", "--num_workers", "1"]
    first = deepspeed([*args, "--max_steps", "3", "--save_steps", "3", "--no_final_checkpoint"])
    assert "a streamed mixture, drawn by label_tokens" in first.stdout
    before = audit(out, 2)
    for rank in range(2):
        (out / f"emitted_ids.rank{rank}.jsonl").rename(out / f"first.rank{rank}.jsonl")
    resumed = deepspeed([*args, "--resume"])
    assert "resumed from" in resumed.stdout
    after = audit(out, 2)
    for rows in (before, after):
        assert len({tuple((r["step"], r["micro"]) for r in rank) for rank in rows}) == 1
    times, firsts = Counter(), Counter()
    for row in [r for rank in before + after for r in rank]:
        for index, name, passed in zip(row["ids"], row["sources"], row["epochs"]):
            key = (name, *shards[name].locate(index))
            times[key] += 1
            firsts[key] += passed == 0
    expected = {(name, *key) for name, s in shards.items() for key in records(s)}
    assert set(times) == expected and all(firsts[key] == 1 for key in expected)
    summary = json.loads((out / "summary.json").read_text())
    shares = {name: figures["share"] for name, figures in summary["sources"].items()}
    repeats = sum(times.values()) - len(expected)
    print(f"a streamed mixture: {sum(times.values())} samples ({repeats} repeats) over {len(before[0])} + "
          f"{len(after[0])} audit rows a rank; label-token shares {shares}")
    assert repeats > 0 and abs(shares["a"] - 0.3) < 0.05 and abs(shares["b"] - 0.7) < 0.05
