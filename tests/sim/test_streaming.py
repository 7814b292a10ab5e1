"""A streaming source (odb/data/streaming.py) under the real batcher over simulated ranks: JSONL
shards, Parquet shards of several row groups, and both in one folder, written here, read by each
rank's own ShardReader. The oracle is the shards themselves, split into lines by Python (a
Parquet shard: read whole by pyarrow): every record trains exactly once per pass, ranks stay
aligned, the shuffle buffer stays within its size, and a resume (same ranks, or re-dealt to
another number) trains the rest exactly once."""

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import check_aligned, run_to_state
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks
from odb.data.streaming import ShardReader, StreamShards

SHARD_LINES = [40, 95, 13, 60, 120, 7, 71]  # uneven on purpose: a pass ends at different times per rank


@pytest.fixture(scope="module", params=["jsonl", "parquet", "mixed"])
def shards(tmp_path_factory, request):
    """Seven shards with lengths 20-600 tokens: JSONL ones with blank lines and a last line without
    its newline, Parquet ones in row groups of 9 rows (``mixed``: every other shard Parquet)."""
    folder = tmp_path_factory.mktemp("shards")
    for shard, count in enumerate(SHARD_LINES):
        values = [{"shard": shard, "line": i, "tokens": 20 + (shard * 37 + i * 53) % 580} for i in range(count)]
        if request.param == "parquet" or (request.param == "mixed" and shard % 2):
            pq.write_table(pa.Table.from_pylist(values), folder / f"part-{shard:03d}.parquet", row_group_size=9)
            continue
        lines = []
        for i, value in enumerate(values):
            lines.append(json.dumps(value))
            if i % 11 == 3:
                lines.append("   ")
        (folder / f"part-{shard:03d}.jsonl").write_text("\n".join(lines) + ("\n" if shard % 2 else ""))
    return StreamShards(folder)


def records(shards):
    """(shard, line) of every record, from the files split by Python or read whole by pyarrow: the oracle."""
    out = set()
    for file in shards.files:
        if file.suffix == ".parquet":
            values = pq.read_table(file).to_pylist()
        else:
            values = [json.loads(text) for text in file.read_text().splitlines() if text.strip()]
        out.update((value["shard"], value["line"]) for value in values)
    return out


class Lengths:
    """What SimulatedFeed reads per dataset index: the record's own token count (read at its offset)."""

    def __init__(self, shards):
        self.shards = shards

    def __len__(self):
        return len(self.shards)

    def __getitem__(self, index):
        return (self.shards.get(index).value["tokens"], 0)


def config(**overrides):
    return OdbConfig(**{"max_tokens": 1024, "window": 24, "lookahead": 8, "sharding": "static", "gas": 2,
                        "cost_model": "manual", "seed": 5, **overrides})


def batcher(comm, shards, cfg, num_epochs=1, buffer_size=16):
    return OnlineBatcher(cfg, comm, dataset_size=len(shards), feed=SimulatedFeed(Lengths(shards)),
                         num_epochs=num_epochs, reader=ShardReader(shards, seed=cfg.seed, buffer_size=buffer_size,
                                                                   chunk_bytes=256))


def trained(steps, shards):
    """Counter of (pass, shard, line) trained."""
    out = Counter()
    for rank_steps in steps:
        for step in rank_steps:
            for micro in step.micro_batches:
                for uid in micro.uids:
                    value = shards.get(uid % len(shards)).value
                    out[(uid // len(shards), value["shard"], value["line"])] += 1
                    assert uid // len(shards) == step.epoch
    return out


@pytest.mark.parametrize("world,policy", [(1, "odb"), (2, "odb"), (3, "odb"), (4, "odb"), (3, "fixed")])
def test_every_line_trains_exactly_once_per_pass(shards, world, policy):
    cfg = config(policy=policy, batch_size=4)
    steps = run_ranks(world, lambda comm: list(batcher(comm, shards, cfg, num_epochs=2)))
    check_aligned(steps)
    expected = Counter((p, s, line) for p in range(2) for s, line in records(shards))
    assert trained(steps, shards) == expected


def test_the_buffer_mixes_within_its_size_and_is_seeded(shards):
    def order(buffer_size, seed=5, pass_index=0):
        reader = ShardReader(shards, seed=seed, buffer_size=buffer_size, chunk_bytes=100)
        reader.start_pass(pass_index, 0, 1)
        return reader.read(10**6)

    scan = order(1)  # a buffer of one: the shards' lines in file order, shard after shard
    assert [shards.locate(u)[0] for u in scan] == sorted((shards.locate(u)[0] for u in scan),
                                                         key=shards.pass_order(5, 0).index)
    for size in (4, 32):
        mixed = order(size)
        assert sorted(mixed) == sorted(scan) and mixed != scan
        read_at = {u: i for i, u in enumerate(scan)}
        assert all(read_at[u] < k + size for k, u in enumerate(mixed))  # never more than the buffer ahead
        assert mixed == order(size)
    assert order(32, seed=6) != order(32)
    assert shards.pass_order(5, 1) != shards.pass_order(5, 0)


@pytest.mark.parametrize("world_after", [2, 3, 1])
def test_resume_mid_pass_by_shard_and_offset(shards, world_after):
    cfg = config()
    whole = run_ranks(2, lambda comm: list(batcher(comm, shards, cfg, num_epochs=2)))
    before, states = run_to_state(lambda comm: batcher(comm, shards, cfg, num_epochs=2), 2, stop_after=5)
    assert any(segment[1] > 0 for s in states for segment in s["reader"]["segments"]), "stopped between shards"
    if world_after != 2:
        states = redeal_states(states, world_after)

    def rank_main(comm):
        b = batcher(comm, shards, cfg, num_epochs=2)
        b.load_state_dict(states[comm.rank])
        return list(b)

    after = run_ranks(world_after, rank_main)
    check_aligned(after)
    steps = before + after
    expected = Counter((p, s, line) for p in range(2) for s, line in records(shards))
    assert trained(steps, shards) == expected
    if world_after == 2:  # the same ranks: the very plans of the uninterrupted run
        assert [[m.uids for s in before[r] + after[r] for m in s.micro_batches] for r in range(2)] == \
               [[m.uids for s in whole[r] for m in s.micro_batches] for r in range(2)]


def test_a_streaming_state_needs_a_streaming_run(shards):
    cfg = config()
    _, states = run_to_state(lambda comm: batcher(comm, shards, cfg, num_epochs=2), 1, stop_after=2)
    with pytest.raises(ValueError, match="streaming source"):
        run_ranks(1, lambda comm: OnlineBatcher(cfg, comm, dataset_size=len(shards),
                                                feed=SimulatedFeed(Lengths(shards))).load_state_dict(states[0]))
    with pytest.raises(ValueError, match="sharding 'static' in mode 'join'"):
        run_ranks(1, lambda comm: batcher(comm, shards, config(sharding="dynamic")))
    with pytest.raises(ValueError, match="use policy 'odb'"):
        run_ranks(1, lambda comm: batcher(comm, shards, config(policy="gmt")))
