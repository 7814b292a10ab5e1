"""A streaming source's data layer (odb/data/streaming.py) against the files themselves: records
read at their byte offsets equal Python's own split and json.loads, Parquet rows read by row group
equal the table pyarrow reads whole (and no more than a row group is decoded at a time), a
processed sample equals the indexed dataset's sample of the same record, the reader's state
continues exactly, the estimate of records, and the settings a stream cannot honour are refused
with the fix."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import bundled_tokenizer, train_defaults
from odb.batching.config import OdbConfig
from odb.data.mixture import parse_source
from odb.data.processing import SampleDataset
from odb.data.row_groups import CACHED_GROUPS
from odb.data.streaming import ShardReader, StreamShards
from odb.recipe import load_recipe
from odb.training.launch.flags import parse_config
from odb.training.run.datasets import build_datasets

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = train_defaults()


def lines_of(file: Path) -> list[tuple[int, bytes]]:
    """(byte offset, line) of every non-blank line, as Python splits the file: the oracle."""
    out, offset = [], 0
    for line in file.read_bytes().splitlines(keepends=True):
        if line.strip():
            out.append((offset, line.rstrip(b"\r\n")))
        offset += len(line)
    return out


def read_all(shards: StreamShards, **kwargs) -> list[int]:
    reader = ShardReader(shards, seed=1, **kwargs)
    reader.start_pass(0, 0, 1)
    return reader.read(10**9)


def test_records_at_their_offsets_equal_the_files_split_by_python(tmp_path):
    rng = random.Random(0)
    for number in range(3):  # a long line (past the 64 KiB first read), blank and bad lines, no final newline
        rows = [json.dumps({"n": number, "i": i, "text": "w" * rng.choice([3, 90, 70_000])}) for i in range(40)]
        rows[5], rows[9] = "  ", "{not json"
        (tmp_path / f"s{number}.jsonl").write_text("\n".join(rows) + ("\n" if number else ""))
    shards = StreamShards(tmp_path)
    expected = {(shard, offset): line for shard, file in enumerate(shards.files) for offset, line in lines_of(file)}
    for chunk_bytes in (64, 1 << 22):
        uids = read_all(shards, buffer_size=7, chunk_bytes=chunk_bytes)
        assert sorted(shards.locate(u) for u in uids) == sorted(expected)
    for (shard, offset), line in expected.items():
        record = shards.get(shard * shards.stride + offset)
        if line == b"{not json":
            assert record.value is None and record.error == "not_json"
            assert record.where == f"{shards.files[shard]}:byte {offset}"
        else:
            assert record.value == json.loads(line)


def write_parquet(file: Path, values: list[dict], row_group_size: int) -> None:
    pq.write_table(pa.Table.from_pylist(values), file, row_group_size=row_group_size)


def test_parquet_rows_read_by_row_group_equal_the_table_read_whole(tmp_path):
    for number in range(3):  # 5 row groups of 8 rows (the last 1-5 rows), nested values
        values = [{"n": number, "i": i, "messages": [{"role": "user", "content": "w" * (i * 37 % 200)}]}
                  for i in range(33 + number)]
        write_parquet(tmp_path / f"s{number}.parquet", values, row_group_size=8)
    shards = StreamShards(tmp_path)
    expected = {(shard, row): value for shard, file in enumerate(shards.files)
                for row, value in enumerate(pq.read_table(file).to_pylist())}
    assert shards.estimate_records(exact_bytes=0) == len(expected) == 102  # the footers' row counts
    uids = read_all(shards, buffer_size=7)
    assert sorted(shards.locate(u) for u in uids) == sorted(expected)
    for uid in uids:  # in the buffer's order, as a DataLoader worker reads them
        record = shards.get(uid)
        shard, row = shards.locate(uid)
        assert record.value == expected[(shard, row)] and record.where == f"{shards.files[shard]}:{row + 1}"
        assert len(shards._groups) <= CACHED_GROUPS and all(len(table) <= 8 for table in shards._groups.values())
    assert shards.largest_row_group()[0] == 8


def test_a_pickled_copy_and_a_forked_process_read_through_handles_of_their_own(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(20)))
    shards = StreamShards(tmp_path)
    offset = lines_of(shards.files[0])[7][0]
    assert shards.get(offset).value == {"i": 7}  # opens this process's handle
    copy = pickle.loads(pickle.dumps(shards))
    assert copy._handles == {} and copy.get(offset).value == {"i": 7}
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(shards.get, (offset,)).value == {"i": 7}
    write_parquet(tmp_path / "b.parquet", [{"i": i} for i in range(20, 40)], row_group_size=6)
    shards = StreamShards(tmp_path)
    row = shards.stride + 13  # shard 1 (b.parquet), row 13
    assert shards.get(row).value == {"i": 33} and shards._groups  # a decoded group, this process's
    copy = pickle.loads(pickle.dumps(shards))
    assert copy._handles == {} and not copy._groups and copy.get(row).value == {"i": 33}
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(shards.get, (row,)).value == {"i": 33}


def test_the_reader_state_continues_exactly(tmp_path):
    for number in range(4):
        (tmp_path / f"s{number}.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(30 + number)))
    shards = StreamShards(tmp_path)
    whole = read_all(shards, buffer_size=5, chunk_bytes=50)
    reader = ShardReader(shards, seed=1, buffer_size=5, chunk_bytes=50)
    reader.start_pass(0, 0, 1)
    head = reader.read(41)
    state = json.loads(json.dumps(reader.state_dict()))
    assert state["segments"][0][1] > 0  # stopped inside a shard
    again = ShardReader(shards, seed=1, buffer_size=5, chunk_bytes=50)
    again.load_state_dict(state)
    assert head + again.read(10**9) == whole and again.is_done


def write_shards(folder: Path, shards: list[list[str]]) -> int:
    folder.mkdir()
    for number, lines in enumerate(shards):
        (folder / f"s{number}.jsonl").write_text("".join(line + "\n" for line in lines))
    return sum(1 for lines in shards for line in lines if line.strip())


@pytest.mark.parametrize("case", ["uniform", "long lines", "mixed lengths", "blank lines"])
def test_the_estimate_of_records(tmp_path, case):
    """Sampled (64 KiB windows over 19 MB, 4 MB, 8 MB and 10 MB) within 1%, whatever the lines'
    lengths: records longer than a window, lengths 200x apart, a third of the lines blank."""
    rng = random.Random(3)
    text = {"uniform": lambda i: "x" * rng.randint(10, 600), "long lines": lambda i: "x" * 100_000,
            "mixed lengths": lambda i: "x" * (200 if i % 2 else 40_000),
            "blank lines": lambda i: "x" * rng.randint(10, 600) if i % 3 else None}[case]
    count = {"uniform": 20_000, "long lines": 40, "mixed lengths": 400, "blank lines": 30_000}[case]
    shards = [[json.dumps({"t": t}) if (t := text(i)) is not None else "  " for i in range(count)]
              for _ in range(3 if case == "uniform" else 1)]
    records = write_shards(tmp_path / "data", shards)
    estimate = StreamShards(tmp_path / "data").estimate_records(exact_bytes=0)
    print(f"{case}: estimated {estimate} records of {records}")
    assert abs(estimate - records) <= max(1, 0.01 * records)


def test_small_data_is_counted_exactly(tmp_path):
    records = write_shards(tmp_path / "data", [["{}"] * 12 + ["", " "] + ["{}"], ['{"a": 1}'], []])
    (tmp_path / "data" / "s1.jsonl").write_text('{"a": 1}')  # no final newline
    assert StreamShards(tmp_path / "data").estimate_records() == records == 14


def test_a_process_keeps_a_bounded_number_of_shards_open(tmp_path):
    write_shards(tmp_path / "data", [[json.dumps({"s": s})] for s in range(150)])
    shards = StreamShards(tmp_path / "data")
    shards.fingerprint()
    assert len(shards._handles) <= 64
    uids = read_all(shards, buffer_size=10)
    assert sorted(shards.get(u).value["s"] for u in uids) == list(range(150)) and len(shards._handles) <= 64


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_streamed_sample_equals_the_indexed_datasets_sample_of_the_same_record(tmp_path, kind):
    tokenizer = bundled_tokenizer()
    data = ROOT / "data" / "chat.jsonl"
    offsets = [offset for offset, _ in lines_of(data)]
    if kind == "parquet":  # the same records as Parquet (memory-mapped through datasets without --streaming)
        data = tmp_path / "chat.parquet"
        write_parquet(data, [json.loads(line) for _, line in lines_of(ROOT / "data" / "chat.jsonl")], 300)
        offsets = list(range(len(offsets)))
    indexed = SampleDataset(data, tokenizer, truncate_to=256)
    streamed = SampleDataset(data, tokenizer, truncate_to=256, streaming=True)
    for record in (0, 3, 301, len(offsets) - 1):
        for epoch in (0, 1):  # augmentation-free here, but the uid carries the pass either way
            mine = streamed[epoch * len(streamed) + offsets[record]]
            theirs = indexed[epoch * len(indexed) + record]
            assert torch.equal(mine["input_ids"], theirs["input_ids"]) and torch.equal(mine["labels"], theirs["labels"])
    with pytest.raises(ValueError, match="no indices or max_samples"):
        SampleDataset(data, tokenizer, streaming=True, max_samples=3)


def test_what_a_stream_cannot_do_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = ["--output_dir", str(tmp_path / "o")]
    config = parse_config(["--data", "data/chat.jsonl", "--streaming", "--shuffle_buffer", "64", *out],
                          defaults=DEFAULTS)
    assert config.data.streaming and config.data.shuffle_buffer == 64
    recipe = tmp_path / "stream.yaml"
    recipe.write_text(json.dumps({"data": "data/chat.jsonl", "streaming": True, "shuffle_buffer": 32,
                                  "output_dir": str(tmp_path / "o")}))
    from_recipe = parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe))
    assert from_recipe.data.streaming and from_recipe.data.shuffle_buffer == 32
    train, held = build_datasets(from_recipe, bundled_tokenizer(), None, truncate_to=None)
    assert isinstance(train.source, StreamShards) and held is None
    for args, match in [(["--val_ratio", "0.1"], "--eval_data instead of --val_ratio"),
                        (["--max_samples", "5"], "stop the run with --max_steps"),
                        (["--shuffle_buffer", "0"], "shuffle_buffer")]:
        with pytest.raises(ValueError, match=match):
            parse_config(["--data", "data/chat.jsonl", "--streaming", *args, *out], defaults=DEFAULTS)
    with pytest.raises(ValueError, match=r"give every source a weight \(NAME=PATH:WEIGHT\)"):
        parse_config(["--data", "a=data/chat.jsonl", "b=data/chat.jsonl", "--streaming", *out], defaults=DEFAULTS)
    odb = tmp_path / "odb.json"
    odb.write_text(json.dumps({**OdbConfig(max_tokens=512).to_dict(), "mode": "quota", "quota": 10}))
    with pytest.raises(ValueError, match="mode 'join'"):
        parse_config(["--data", "data/chat.jsonl", "--streaming", "--odb_config", str(odb), *out], defaults=DEFAULTS)
    odb.write_text(json.dumps({**OdbConfig(max_tokens=512).to_dict(), "policy": "gmt", "sharding": "static"}))
    with pytest.raises(ValueError, match="use policy 'odb'"):
        parse_config(["--data", "data/chat.jsonl", "--streaming", "--odb_config", str(odb), *out], defaults=DEFAULTS)
    with pytest.raises(ValueError, match="streaming is the run's, for every source at once"):
        parse_source('{"name": "a", "path": "p", "streaming": true}')
    (tmp_path / "rows.json").write_text("[{}]")
    with pytest.raises(FileNotFoundError, match="drop --streaming"):
        StreamShards(tmp_path / "rows.json")
    (tmp_path / "rows.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="rows.parquet is not a readable Parquet file"):
        StreamShards(tmp_path / "rows.parquet")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text("{}\n")
    write_parquet(tmp_path / "mixed" / "b.parquet", [{"i": 1}], 1)
    assert StreamShards(tmp_path / "mixed").estimate_records() == 2  # JSONL and Parquet shards in one folder
    (tmp_path / "mixed" / "c.json").write_text("[{}]")
    with pytest.raises(ValueError, match="beside its shards"):
        StreamShards(tmp_path / "mixed")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        StreamShards(tmp_path / "empty")


def test_weighted_sources_stream_as_a_mixture_each_source_a_shard_a_rank(tmp_path, monkeypatch):
    """--streaming with weighted sources builds a streamed mixture: its sources' streams end to end,
    a MixedReader over one ShardReader each; a record at the reader's uid is that source's own
    record (the files: Python's split, pyarrow's table); a source with fewer shards than ranks is
    refused naming the fix."""
    from odb.batching.stream_mixture import MixedReader
    from odb.data.mixture import MixedDataset
    from odb.training.run.datasets import streaming_reader

    monkeypatch.chdir(ROOT)
    chat = [json.loads(line) for _, line in lines_of(ROOT / "data" / "chat.jsonl")]
    (tmp_path / "a").mkdir()
    for number in range(3):
        (tmp_path / "a" / f"s{number}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat[number::3][:20]))
    (tmp_path / "b").mkdir()
    for number in range(2):
        write_parquet(tmp_path / "b" / f"s{number}.parquet", chat[100 + 30 * number:130 + 30 * number], 8)
    out = ["--output_dir", str(tmp_path / "o")]
    config = parse_config(["--data", f"a={tmp_path / 'a'}:0.7", f"b={tmp_path / 'b'}:0.3", "--streaming",
                           "--mix_epoch", "first", *out], defaults=DEFAULTS)
    train, _ = build_datasets(config, bundled_tokenizer(), None, truncate_to=None)
    assert isinstance(train, MixedDataset) and all(isinstance(p.source, StreamShards) for p in train.parts)
    logged = []
    batching, reader, planned = streaming_reader(config, config.batching, train, 2, logged.append)
    assert isinstance(reader, MixedReader) and batching.sharding == "static" and reader.epoch_rule == "first"
    assert planned == round(0.3 / 0.7 * 60) + 60  # "first", as if every record carried as many units
    reader.start_pass(0, 0, 2)
    uids = reader.read(5)
    assert uids
    for uid in uids:
        source, local = train.locate(uid % len(train))
        shards = train.parts[source].source
        assert train[uid]["source"] == source and shards.get(local).value in chat
    with pytest.raises(ValueError, match="source 'b' has 2 shard.s. for 3 ranks: split it into at least 3 shards"):
        streaming_reader(config, config.batching, train, 3, logged.append)
