#!/usr/bin/env python
"""Data sources at scale: index time, memory and random-access latency of a JSONL file of millions
of records, and of a Parquet file, odb's readers before and after the memory-mapped index.

    python tools/bench/bench_sources.py --records 1000000,10000000 --json

Writes synthetic chat records (a few hundred bytes each) into a temporary folder (or ``--dir``)
and deletes them at the end. For each record count, each JSONL reader runs in a fresh process
(a rank): ``old`` is odb's reader before the index (copied below as :class:`_OldJsonLines`: a
list of ``(offset, line)`` tuples, a file opened per get, the fingerprint over the offsets' JSON),
``new`` is :class:`odb.data.sources.Source`. The rank indexes the file (``new``: first with no
index file, then again reading it), takes the fingerprint, then forks ``--workers`` processes (as
DataLoader workers are forked) that each time ``--gets`` random gets and then touch every
record's index entry (what an epoch does). Memory comes from ``/proc/self/smaps_rollup`` (see
:func:`memory`); the table shows anonymous PSS, the memory a process costs that the kernel cannot
drop (a page shared copy-on-write with the rank counts by its share), and file PSS, the page-cache
pages it maps (a memory-mapped index: shared by every process on the node, and reclaimable); for
workers, the larger of the workers' figures.
The file stays in the page cache throughout, so the times are CPU, not disk.

Parquet (``--parquet_rows`` rows in 4 row groups): odb's reader (Hugging Face ``datasets``:
converted once into its cache, then memory-mapped; the same before and after) against the
alternative not chosen, reading row groups with pyarrow and keeping the last two decoded (timed
over at most 1000 gets: each miss decodes a whole row group).

A streaming source (``--streaming``, :mod:`odb.data.streaming`; reader ``streaming``) indexes
nothing: a fresh process opens the same file as one shard, takes the fingerprint and the records
estimate, reads every record through a :class:`odb.data.streaming.ShardReader` (a buffer of
10,000) as a rank does over a pass, then forks the workers, which each time ``--gets`` gets of
records in the order the reader handed them out (what a DataLoader worker reads). With Parquet
and the ``streaming`` reader, the same for the Parquet file as one streamed shard (its rows from
the footer; a worker decodes each record's row group and keeps the last two).

When the largest file would not fit comfortably on the disk (3x its size, for the file and the
caches), the tool measures 1M and 3M records instead and extrapolates linearly, saying so.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

ROW_GROUP_GETS = 1000  # at most, for the row-group reader: a miss decodes a whole group
BYTES_PER_RECORD = 390  # about what records() writes, for the disk check
WORDS = "the a model data token batch rank loss step river apple train sample length cost gpu".split()


class _OldJsonLines:
    """odb's JSONL reader before the memory-mapped index (odb/data/sources.py at 177d20b)."""

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

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(f"{self.file.name}:{self.file.stat().st_size}:{len(self)};".encode())
        digest.update(json.dumps(self.offsets).encode())
        return digest.hexdigest()[:16]

    def get(self, local: int) -> dict | None:
        offset, number = self.offsets[local]
        with open(self.file, "rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None


class _RowGroups:
    """The Parquet reader not chosen: row groups read with pyarrow on access, the last two kept."""

    def __init__(self, file: Path) -> None:
        import pyarrow.parquet as pq

        self.parquet = pq.ParquetFile(file)
        rows = [self.parquet.metadata.row_group(g).num_rows for g in range(self.parquet.num_row_groups)]
        self.starts = np.cumsum([0, *rows])
        self.groups: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, index: int) -> dict:
        group = int(np.searchsorted(self.starts, index, side="right")) - 1
        if group not in self.groups:
            self.groups[group] = self.parquet.read_row_group(group)
            if len(self.groups) > 2:
                self.groups.popitem(last=False)
        return self.groups[group].slice(index - int(self.starts[group]), 1).to_pylist()[0]


def records(count: int, seed: int = 0):
    """``count`` chat records of a few hundred bytes, as JSON lines."""
    rng = random.Random(seed)
    questions = [" ".join(rng.choices(WORDS, k=rng.randint(8, 40))) for _ in range(4096)]
    answers = [" ".join(rng.choices(WORDS, k=rng.randint(10, 50))) for _ in range(4096)]
    for i in range(count):
        question, answer = questions[rng.getrandbits(12)], answers[rng.getrandbits(12)]
        yield (f'{{"id": {i}, "messages": [{{"role": "user", "content": "{question}"}}, '  # plain words: no escapes
               f'{{"role": "assistant", "content": "{answer}"}}]}}\n')


def write_jsonl(path: Path, count: int) -> None:
    with open(path, "w") as f:
        batch = []
        for line in records(count):
            batch.append(line)
            if len(batch) == 100_000:
                f.write("".join(batch))
                batch.clear()
        f.write("".join(batch))


def memory() -> dict[str, float]:
    """This process's memory in MB from /proc/self/smaps_rollup: RSS, PSS, USS and PSS split into
    anonymous and file-backed pages (RSS alone from /proc/self/status where the kernel has no
    rollup). Not USS or private dirty for what a process costs: both count the page-cache pages of
    a file just written (an index) as the process's own while no other process maps them."""
    try:
        fields = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in open("/proc/self/smaps_rollup")
                  if line.split(":")[0] in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Private_Clean", "Private_Dirty")}
        return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"],
                "pss_anon": fields["Pss_Anon"], "pss_file": fields["Pss_File"]}
    except (OSError, KeyError):
        rss = next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
        return {"rss": rss, "pss": None, "uss": None, "pss_anon": None, "pss_file": None}


def timed_gets(get, size: int, gets: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    picks = [rng.randrange(size) for _ in range(gets)]
    times = np.empty(gets)
    for k, i in enumerate(picks):
        start = time.perf_counter_ns()
        get(i)
        times[k] = (time.perf_counter_ns() - start) / 1000
    return {"get_mean_us": float(times.mean()), "get_p99_us": float(np.percentile(times, 99))}


def _worker(get, touch, size: int, gets: int, seed: int, results) -> None:
    out = timed_gets(get, size, gets, seed)
    out["after_gets"] = memory()
    touch()
    gc.collect()
    out["after_touching_all"] = memory()
    results.put(out)


def _rank(reader: str, path: str, gets: int, workers: int, results) -> None:
    """One rank: index, fingerprint, then forked workers reading at random."""
    from odb.data.index import SUFFIX
    from odb.data.sources import Source

    path = Path(path)
    out = {"before": memory()}
    if reader == "old":
        start = time.perf_counter()
        source = _OldJsonLines(path)
        out["index_first_s"] = time.perf_counter() - start
        out["index_reuse_s"] = None  # built again by every process of every run
        start = time.perf_counter()
        source.fingerprint()
        out["fingerprint_s"] = time.perf_counter() - start

        def touch():
            for entry in source.offsets:
                entry[0]
    else:
        Path(str(path) + SUFFIX).unlink(missing_ok=True)
        _, out["index_first_s"] = timed(Source, path)
        source, out["index_reuse_s"] = timed(Source, path)
        _, out["fingerprint_s"] = timed(source.fingerprint)

        def touch():
            int(source.parts[0][1].index.offsets.sum())
    gc.collect()
    out["rank"] = memory()
    out["workers"] = forked(_worker, [(source.get, touch, len(source), gets, seed) for seed in range(workers)])
    results.put(out)


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took."""
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def forked(target, jobs: list[tuple]) -> list:
    """What ``target(*job, queue)`` puts on the queue, each job in a process forked from this one
    (as DataLoader workers are forked from their rank)."""
    fork = multiprocessing.get_context("fork")
    queue = fork.Queue()
    processes = [fork.Process(target=target, args=(*job, queue)) for job in jobs]
    for process in processes:
        process.start()
    out = [queue.get() for _ in processes]
    for process in processes:
        process.join()
    return out


def _stream(path: str, gets: int, workers: int, results) -> None:
    """One rank of a streaming source: open, fingerprint, estimate, a whole pass, then workers
    reading records in the reader's order."""
    from odb.data.streaming import ShardReader, StreamShards

    out = {"before": memory()}
    shards, out["open_s"] = timed(StreamShards, path)
    _, out["fingerprint_s"] = timed(shards.fingerprint)
    out["estimate"], out["estimate_s"] = timed(shards.estimate_records)
    reader = ShardReader(shards, seed=0, buffer_size=10_000)
    reader.start_pass(0, 0, 1)
    start, read, order = time.perf_counter(), 0, []
    while not reader.is_done:
        uids = reader.read(100_000)
        read += len(uids)
        if len(order) < gets * workers:
            order.extend(uids[:gets * workers - len(order)])
    out["scan_s"], out["read"] = time.perf_counter() - start, read
    gc.collect()
    out["rank"] = memory()
    out["workers"] = forked(_stream_worker, [(shards, order[w::workers]) for w in range(workers)])
    results.put(out)


def _stream_worker(shards, uids: list[int], results) -> None:
    times = np.empty(len(uids))
    for k, uid in enumerate(uids):
        start = time.perf_counter_ns()
        shards.get(uid)
        times[k] = (time.perf_counter_ns() - start) / 1000
    results.put({"get_mean_us": float(times.mean()), "get_p99_us": float(np.percentile(times, 99)),
                 "after_gets": memory()})


def _parquet(reader: str, path: str, gets: int, results) -> None:
    start = time.perf_counter()
    if reader == "datasets":
        import datasets  # noqa: F401 - imported by the first open
    else:
        import pyarrow.parquet  # noqa: F401
    out = {"import_s": time.perf_counter() - start}
    start = time.perf_counter()
    if reader == "datasets":
        from odb.data.sources import Source

        source = Source(path)
    else:
        source = _RowGroups(Path(path))
    out["open_s"] = time.perf_counter() - start
    gets = gets if reader == "datasets" else min(gets, ROW_GROUP_GETS)
    out["gets"] = gets
    out.update(timed_gets(source.get, len(source), gets, seed=0))
    out["after_gets"] = memory()
    results.put(out)


def in_fresh_process(target, *args):
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    process = spawn.Process(target=target, args=(*args, queue))
    process.start()
    out = queue.get()
    process.join()
    return out


def bench_jsonl(folder: Path, count: int, gets: int, workers: int, readers=("old", "new", "streaming")) -> dict:
    path = folder / f"chat_{count}.jsonl"
    start = time.perf_counter()
    write_jsonl(path, count)
    result = {"records": count, "file_mb": path.stat().st_size / 2**20, "write_s": time.perf_counter() - start}
    for reader in readers:
        print(f"  {count:,} records: {reader} reader", file=sys.stderr, flush=True)
        if reader == "streaming":
            result[reader] = in_fresh_process(_stream, str(path), gets, workers)
        else:
            result[reader] = in_fresh_process(_rank, reader, str(path), gets, workers)
    for leftover in folder.glob(path.name + "*"):
        leftover.unlink()
    return result


def bench_parquet(folder: Path, rows: int, gets: int, workers: int, streaming: bool) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "chat.parquet"
    table = pa.Table.from_pylist([json.loads(line) for line in records(rows, seed=1)])
    pq.write_table(table, path, row_group_size=-(-rows // 4))
    del table
    result = {"rows": rows, "row_groups": pq.ParquetFile(path).num_row_groups, "file_mb": path.stat().st_size / 2**20}
    readers = (("datasets", "datasets_first"), ("datasets", "datasets_cached"), ("row_groups", "pyarrow_row_groups"))
    for reader, label in readers:
        print(f"  parquet: {label}", file=sys.stderr, flush=True)
        result[label] = in_fresh_process(_parquet, reader, str(path), gets)
    if streaming:
        print("  parquet: streaming", file=sys.stderr, flush=True)
        result["streaming"] = in_fresh_process(_stream, str(path), gets, workers)
    return result


def extrapolate(small: dict, large: dict, count: int) -> dict:
    """A straight line through two measured record counts, for every number in them."""
    def line(a, b):
        if isinstance(a, dict):
            return {k: line(a[k], b[k]) for k in a}
        if isinstance(a, list):
            return [line(x, y) for x, y in zip(a, b)]
        if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)):
            return a + (b - a) * (count - small["records"]) / (large["records"] - small["records"])
        return a
    return {**line(small, large), "records": count, "extrapolated_from": [small["records"], large["records"]]}


def table(report: dict) -> str:
    def mb(value):
        return "-" if value is None else f"{value:,.0f}"

    rows = ["| records | reader | index, first (s) | index, reused (s) | fingerprint (s) | rank: anon growth (MB) "
            "| worker: anon after gets / after all (MB) | worker: file after all (MB) | get mean / p99 (us) |",
            "|---|---|---|---|---|---|---|---|---|"]
    if not any("old" in result or "new" in result for result in report["jsonl"]):
        rows = []
    for result in report["jsonl"]:
        note = " (extrapolated)" if "extrapolated_from" in result else ""
        for reader in [r for r in ("old", "new") if r in result]:
            r, workers = result[reader], result[reader]["workers"]
            reuse = "rebuilt" if r["index_reuse_s"] is None else f"{r['index_reuse_s']:.3f}"
            anon = None if r["rank"]["pss_anon"] is None else r["rank"]["pss_anon"] - r["before"]["pss_anon"]
            gets, everything = (_worst(workers, moment, "pss_anon") for moment in ("after_gets", "after_touching_all"))
            mean_us = sum(w["get_mean_us"] for w in workers) / len(workers)
            rows.append(f"| {result['records']:,}{note} | {reader} | {r['index_first_s']:.2f} | {reuse} "
                        f"| {r['fingerprint_s']:.3f} | {mb(anon)} | {mb(gets)} / {mb(everything)} "
                        f"| {mb(_worst(workers, 'after_touching_all', 'pss_file'))} "
                        f"| {mean_us:.0f} / {max(w['get_p99_us'] for w in workers):.0f} |")
    streamed = [result for result in report["jsonl"] if "streaming" in result]
    if streamed:
        rows += ["", "| records | streaming: open (s) | fingerprint (s) | estimate (s) | estimated records "
                 "| a pass read (s) | records/s | rank: anon growth (MB) | worker: anon after gets (MB) "
                 "| get mean / p99 (us) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for result in streamed:
            r, workers = result["streaming"], result["streaming"]["workers"]
            anon = None if r["rank"]["pss_anon"] is None else r["rank"]["pss_anon"] - r["before"]["pss_anon"]
            mean_us = sum(w["get_mean_us"] for w in workers) / len(workers)
            worker = _worst(workers, "after_gets", "pss_anon")
            rows.append(f"| {result['records']:,} | {r['open_s']:.3f} | {r['fingerprint_s']:.3f} "
                        f"| {r['estimate_s']:.3f} | {r['estimate']:,.0f} | {r['scan_s']:.1f} "
                        f"| {r['read'] / r['scan_s']:,.0f} | {mb(anon)} | {mb(worker)} "
                        f"| {mean_us:.0f} / {max(w['get_p99_us'] for w in workers):.0f} |")
    if report.get("parquet"):
        p = report["parquet"]
        rows += ["", f"| Parquet, {p['rows']:,} rows in {p['row_groups']} row groups | import (s) | open (s) "
                 "| get mean / p99 (us) | anon / file after gets (MB) |", "|---|---|---|---|---|"]
        for label, name in (("datasets_first", "datasets, first open (converts)"),
                            ("datasets_cached", "datasets, a later open (each rank)"),
                            ("pyarrow_row_groups", "pyarrow row groups, 2 kept (not chosen)")):
            r, m = p[label], p[label]["after_gets"]
            rows.append(f"| {name} | {r['import_s']:.2f} | {r['open_s']:.3f} | {r['get_mean_us']:,.0f} / "
                        f"{r['get_p99_us']:,.0f} | {mb(m['pss_anon'])} / {mb(m['pss_file'])} |")
        if "streaming" in p:
            r, workers = p["streaming"], p["streaming"]["workers"]
            mean_us = sum(w["get_mean_us"] for w in workers) / len(workers)
            rows += ["", f"| Parquet streamed, {p['rows']:,} rows | open (s) | fingerprint (s) | records counted "
                     "| a pass read (s) | records/s | worker: anon after gets (MB) | get mean / p99 (us) |",
                     "|---|---|---|---|---|---|---|---|"]
            rows.append(f"| one shard, buffer 10,000 | {r['open_s']:.3f} | {r['fingerprint_s']:.3f} "
                        f"| {r['estimate']:,.0f} | {r['scan_s']:.1f} | {r['read'] / r['scan_s']:,.0f} "
                        f"| {mb(_worst(workers, 'after_gets', 'pss_anon'))} "
                        f"| {mean_us:,.0f} / {max(w['get_p99_us'] for w in workers):,.0f} |")
    return "\n".join(rows)


def _worst(workers: list[dict], moment: str, key: str) -> float | None:
    values = [worker[moment][key] for worker in workers]
    return None if None in values else max(values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default="1000000,10000000", help="JSONL record counts, comma-separated")
    parser.add_argument("--parquet_rows", type=int, default=1_000_000, help="0 leaves Parquet out")
    parser.add_argument("--gets", type=int, default=10_000, help="random gets per worker")
    parser.add_argument("--workers", type=int, default=2, help="forked workers per rank")
    parser.add_argument("--readers", default="old,new,streaming",
                        help="JSONL readers, comma-separated: old, new (the index), streaming")
    parser.add_argument("--dir", help="where to write the data (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    counts = sorted(int(c) for c in args.records.split(","))
    folder = Path(tempfile.mkdtemp(prefix="odb-bench-sources-", dir=args.dir))
    os.environ["HF_DATASETS_CACHE"] = str(folder / "hf")  # datasets' Parquet conversion, deleted below
    free = shutil.disk_usage(folder).free
    measured, notes = counts, []
    if 3 * counts[-1] * BYTES_PER_RECORD > free:
        measured = sorted({c for c in counts if 3 * c * BYTES_PER_RECORD <= free} | {1_000_000, 3_000_000})
        notes.append(f"{free / 2**30:.0f} GiB free on {folder}: measured {measured}, the rest extrapolated "
                     "linearly from 1M and 3M records")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "gets": args.gets,
                    "workers": args.workers, "jsonl": [], "notes": notes}
    try:
        readers = tuple(args.readers.split(","))
        done = {count: bench_jsonl(folder, count, args.gets, args.workers, readers) for count in measured}
        for count in counts:
            report["jsonl"].append(done.get(count) or extrapolate(done[1_000_000], done[3_000_000], count))
        if args.parquet_rows:
            report["parquet"] = bench_parquet(folder, args.parquet_rows, args.gets, args.workers,
                                              "streaming" in readers)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        print(table(report))
        for note in notes:
            print(f"note: {note}")


if __name__ == "__main__":
    main()
