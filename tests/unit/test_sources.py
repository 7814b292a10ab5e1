"""Data sources: the JSONL index (built, reused, rebuilt, shared by processes), handles after fork,
Parquet and save_to_disk folders, each against a reader that shares no code with odb's: Python's
own line iteration with json.loads, pyarrow's whole-file read."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
import random
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from odb.data import index as line_index
from odb.data.index import SUFFIX, build_index, load_line_index, read_index
from odb.data.sources import Source

FORK = multiprocessing.get_context("fork")
PIECES = ['{"a": 1}', '{"text": "caf\u00e9 \u2028 \U0001f600"}', '  {"indented": true}', "", "  ", "\t", "\r",
          " \r", "[1, 2]", "not json", '{"cut": ', '"just a string"', '{"k": "' + "x" * 40 + '"}']


def oracle(path):
    """``(offset, "file:line", value or skip reason)`` of each non-blank line, by Python's own
    iteration over the file's lines."""
    records, offset = [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    value = json.loads(line)
                    value = value if isinstance(value, dict) else "not_an_object"
                except ValueError:
                    value = "not_json"
                records.append((offset, f"{path}:{number}", value))
            offset += len(line)
    return records


def read_all(source):
    return [(r.where, r.value if r.value is not None else r.error) for r in map(source.get, range(len(source)))]


def random_jsonl(path, seed, lines=60):
    rng = random.Random(seed)
    newline = rng.choice(["\n", "\r\n"])
    text = newline.join(rng.choice(PIECES) for _ in range(lines)) + rng.choice(["", newline, newline * 3])
    path.write_bytes(text.encode())
    return path


def set_mtime(path, seconds_later):
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + int(seconds_later * 1e9)))


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 8 << 20])
@pytest.mark.parametrize("seed", range(6))
def test_jsonl_offsets_and_records_equal_python_line_iteration(tmp_path, monkeypatch, chunk_bytes, seed):
    # blank and white-space lines, CRLF, with and without a last newline, unicode, lines cut by chunks
    monkeypatch.setattr(line_index, "CHUNK_BYTES", chunk_bytes)
    path = random_jsonl(tmp_path / "d.jsonl", seed)
    expected = oracle(path)
    assert [int(o) for o in load_line_index(path).offsets] == [offset for offset, _, _ in expected]
    assert read_all(Source(path)) == [(where, value) for _, where, value in expected]


@pytest.mark.parametrize("text", [b'{"a": 1}', b'\n\n{"a": 1}\n\n', b'{"a": 1}\r\n\r\n{"b": 2}', b" \n{}\n \t "])
def test_edges_of_a_file(tmp_path, text):
    path = tmp_path / "d.jsonl"
    path.write_bytes(text)
    assert read_all(Source(path)) == [(where, value) for _, where, value in oracle(path)]


def test_a_file_of_blank_lines_holds_no_records(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n  \n\r\n")
    with pytest.raises(ValueError, match="holds no records"):
        Source(tmp_path / "d.jsonl")


def test_the_index_is_reused_while_size_and_mtime_match_and_rebuilt_when_not(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    assert read_all(Source(path))[1][1] == {"a": 2}
    index_file = tmp_path / ("d.jsonl" + SUFFIX)
    built = index_file.stat().st_ino
    assert read_all(Source(path))[1][1] == {"a": 2} and index_file.stat().st_ino == built  # read, not rewritten
    path.write_text('{"a": 1}\n{"a": 3}\n')  # the same size: the mtime tells
    set_mtime(path, 2)
    assert read_all(Source(path))[1][1] == {"a": 3} and index_file.stat().st_ino != built
    path.write_text('{"a": 1}\n\n{"b": 33}\n{"c": 4}\n')
    assert read_all(Source(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:3", {"b": 33}), (f"{path}:4", {"c": 4})]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith((".lock", ".tmp"))]


def test_a_damaged_index_is_rebuilt(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n')
    Source(path)
    (tmp_path / ("d.jsonl" + SUFFIX)).write_bytes(b"not an index")
    assert read_all(Source(path)) == [(f"{path}:1", {"a": 1})]


def test_fingerprint_changes_with_the_contents_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    before = Source(path).fingerprint()
    set_mtime(path, 2)  # rebuilt, same bytes
    assert Source(path).fingerprint() == before
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "d.jsonl").write_bytes(path.read_bytes())
    assert Source(tmp_path / "elsewhere" / "d.jsonl").fingerprint() == before  # the folder does not count
    path.write_text('{"a": 1}\n{"a": 3}\n')  # one line, same length, same offsets
    set_mtime(path, 4)
    changed = Source(path).fingerprint()
    assert changed != before and len(changed) == 16 and int(changed, 16) >= 0


def test_a_read_only_data_folder_falls_back_to_cache_dir(tmp_path, monkeypatch):
    data, cache = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    path = random_jsonl(data / "d.jsonl", seed=1)
    real_open = os.open

    def read_only_open(file, flags, *args):  # root ignores the mode bits below
        if str(file).startswith(str(data)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", read_only_open)
    data.chmod(0o555)
    try:
        expected = [(where, value) for _, where, value in oracle(path)]
        assert read_all(Source(path, cache_dir=cache)) == expected
        assert list(data.iterdir()) == [path]
        [index_file] = (cache / "data_index").iterdir()
        built = index_file.stat().st_ino
        assert read_all(Source(path, cache_dir=cache)) == expected and index_file.stat().st_ino == built
        assert read_all(Source(path)) == expected  # nowhere to write: kept in memory
    finally:
        data.chmod(0o755)


def _read_at_once(path, barrier, results):
    barrier.wait()
    source = Source(path)
    results.put((read_all(source), source.fingerprint()))


def test_processes_that_index_at_once_end_with_one_valid_index(tmp_path, monkeypatch):
    monkeypatch.setattr(line_index, "CHUNK_BYTES", 4096)  # a build of many chunks, so that they overlap
    path = random_jsonl(tmp_path / "d.jsonl", seed=2, lines=20_000)
    barrier, results = FORK.Barrier(3), FORK.Queue()
    processes = [FORK.Process(target=_read_at_once, args=(path, barrier, results)) for _ in range(3)]
    for process in processes:
        process.start()
    seen = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    expected = [(where, value) for _, where, value in oracle(path)]
    assert all(records == expected for records, _ in seen) and len({fingerprint for _, fingerprint in seen}) == 1
    assert read_index(tmp_path / ("d.jsonl" + SUFFIX), (path.stat().st_size, path.stat().st_mtime_ns))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "d.jsonl" + SUFFIX]


def test_a_process_waits_for_the_builder_and_says_so(tmp_path, capsys):
    path = random_jsonl(tmp_path / "d.jsonl", seed=3)
    lock = tmp_path / ("d.jsonl" + SUFFIX + ".lock")
    lock.write_text("node7 pid 42")

    def builder():
        time.sleep(0.5)
        line_index._write(tmp_path / ("d.jsonl" + SUFFIX), build_index(path), path)
        lock.unlink()

    thread = threading.Thread(target=builder)
    thread.start()
    assert read_all(Source(path)) == [(where, value) for _, where, value in oracle(path)]
    thread.join()
    assert "waiting for node7 pid 42 to index" in capsys.readouterr().err


def test_a_lock_nobody_touches_is_not_waited_for(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(line_index, "STALE_S", 0.3)
    path = random_jsonl(tmp_path / "d.jsonl", seed=4)
    (tmp_path / ("d.jsonl" + SUFFIX + ".lock")).write_text("node7 pid 42")
    assert read_all(Source(path)) == [(where, value) for _, where, value in oracle(path)]
    assert "not touched for 0 s" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "d.jsonl" + SUFFIX]  # the lock is gone


def _read_in_child(source, results):
    records = read_all(source)
    results.put((os.getpid(), source.parts[0][1]._pid, records))


def test_a_forked_worker_reads_through_its_own_handle_and_a_pickle_carries_none(tmp_path):
    path = random_jsonl(tmp_path / "d.jsonl", seed=5)
    expected = [(where, value) for _, where, value in oracle(path)]
    source = Source(path)
    assert read_all(source) == expected  # the parent's handle is open
    results = FORK.Queue()
    child = FORK.Process(target=_read_in_child, args=(source, results))
    child.start()
    pid, handle_pid, records = results.get(timeout=60)
    child.join(timeout=60)
    assert handle_pid == pid != os.getpid() and records == expected
    assert read_all(source) == expected  # the parent's handle, untouched by the child's reads
    copy = pickle.loads(pickle.dumps(source))  # a spawned worker's copy: no handle, no mapped index
    assert copy.parts[0][1].index is None and read_all(copy) == expected


def test_a_folder_is_its_files_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.jsonl").write_text('{"n": 3}\n')
    (tmp_path / "a.jsonl").write_text('{"n": 1}\n{"n": 2}\n')
    (tmp_path / "b" / "empty.jsonl").write_text("\n")
    (tmp_path / "c.json").write_text(json.dumps([{"n": 4}, 5]))
    (tmp_path / "notes.txt").write_text("not data")
    assert [value for _, value in read_all(Source(tmp_path))] == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4},
                                                                  "not_an_object"]


def test_parquet_with_several_row_groups_equals_pyarrow(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i} \u00e9"}, {"role": "assistant", "content": "a" * i}],
             "id": i} for i in range(53)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    assert pq.ParquetFile(path).metadata.num_row_groups == 8
    expected = pq.read_table(path).to_pylist()
    got = read_all(Source(path))
    assert got == [(f"{path}:{i + 1}", row) for i, row in enumerate(expected)]


def test_a_save_to_disk_folder_is_a_source_alone_or_in_a_folder(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(5)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data" / "saved"))
    saved = tmp_path / "data" / "saved"
    assert read_all(Source(saved)) == [(f"{saved}:{i + 1}", row) for i, row in enumerate(rows)]
    (tmp_path / "data" / "more.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert len(Source(tmp_path / "data")) == 6  # its state.json and dataset_info.json are not records
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"DatasetDict \(splits test, train\).*--data .*splits/test"):
        Source(tmp_path / "splits")
