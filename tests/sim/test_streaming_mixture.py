"""A weighted mixture of streaming sources (odb/batching/stream_mixture.py) under the real batcher
over simulated ranks: three sources of JSONL shards, Parquet shards and both, whose records' token
counts differ 30x, each rank drawing from its own readers. The oracle is the files themselves
(split by Python, read whole by pyarrow): each record's own token count gives every source's
trained units, which must hold its weight's share within one record per rank; every record
trains at least once an epoch (``all``, its first pass exactly once) or at most once (``first``);
ranks stay aligned; a resume on the same ranks continues the very plans."""

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import check_aligned, run_to_state
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks
from odb.batching.stream_mixture import MixedReader
from odb.data.streaming import ShardReader, StreamShards

MAX_TOKENS = 2048
SOURCES = {  # name: (shards' records, token range, kind)
    "chat": ([40, 95, 13, 60, 120, 7, 71], (20, 60), "jsonl"),
    "code": ([9, 14, 6, 11, 8], (600, 1800), "parquet"),
    "math": ([20, 35, 18, 27, 30, 22], (100, 300), "mixed"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each source's shards; every 13th record a skip (the data layer refuses it: no units)."""
    out = []
    for number, (name, (counts, (low, high), kind)) in enumerate(SOURCES.items()):
        folder = tmp_path_factory.mktemp(name)
        rng = np.random.default_rng(number)
        for shard, count in enumerate(counts):
            values = [{"source": name, "shard": shard, "line": i, "tokens": int(rng.integers(low, high)),
                       "skip": i % 13 == 5} for i in range(count)]
            if kind == "parquet" or (kind == "mixed" and shard % 2):
                pq.write_table(pa.Table.from_pylist(values), folder / f"part-{shard:03d}.parquet", row_group_size=7)
            else:
                (folder / f"part-{shard:03d}.jsonl").write_text("\n\n".join(json.dumps(v) for v in values) + "\n")
        out.append(StreamShards(folder))
    return out


def records(shards):
    """Every record of a source's files, by (shard, line): the oracle."""
    out = {}
    for file in shards.files:
        if file.suffix == ".parquet":
            values = pq.read_table(file).to_pylist()
        else:
            values = [json.loads(text) for text in file.read_text().splitlines() if text.strip()]
        out.update({(value["shard"], value["line"]): value for value in values})
    return out


class Lengths:
    """What SimulatedFeed reads per dataset index of the mixture: the record's own tokens (None: a skip)."""

    def __init__(self, sources):
        self.sources = sources
        self.starts = np.cumsum([0] + [len(s) for s in sources])

    def __len__(self):
        return int(self.starts[-1])

    def locate(self, index):
        source = int(np.searchsorted(self.starts, index, side="right")) - 1
        return source, self.sources[source].get(index - int(self.starts[source])).value

    def __getitem__(self, index):
        value = self.locate(index)[1]
        return None if value["skip"] else (value["tokens"], 0)


def config(**overrides):
    return OdbConfig(**{"max_tokens": MAX_TOKENS, "window": 24, "lookahead": 8, "sharding": "static", "gas": 2,
                        "cost_model": "manual", "seed": 5, **overrides})


def batcher(comm, sources, cfg, *, weights, rule="all", mix_by="label_tokens", num_epochs=1):
    readers = [ShardReader(s, seed=cfg.seed, buffer_size=8, chunk_bytes=512) for s in sources]
    reader = MixedReader(readers, [len(s) for s in sources], weights, mix_by=mix_by, epoch_rule=rule,
                         num_epochs=num_epochs)
    lengths = Lengths(sources)
    return OnlineBatcher(cfg, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths), num_epochs=num_epochs,
                         reader=reader)


def trained(steps, sources, num_epochs):
    """Per epoch: each source's units (label tokens: tokens - 1) and the times each record trained,
    and whether it was in its first pass (the record's own pass is the epoch)."""
    lengths = Lengths(sources)
    size = len(lengths)
    units = [[0] * len(sources) for _ in range(num_epochs)]
    times = [Counter() for _ in range(num_epochs)]
    first = [Counter() for _ in range(num_epochs)]
    for rank_steps in steps:
        for step in rank_steps:
            for micro in step.micro_batches:
                for uid in micro.uids:
                    source, value = lengths.locate(uid % size)
                    assert not value["skip"], "a skipped record trained"
                    key = (value["source"], value["shard"], value["line"])
                    units[step.epoch][source] += value["tokens"] - 1
                    times[step.epoch][key] += 1
                    first[step.epoch][key] += uid // size == step.epoch
    return units, times, first


def check_shares(units, weights, world, sources):
    """Each source within one record per rank of its weight's share of the trained units: on a rank
    every source ends within one of its records of ``w * L``, and the total moves with the others'
    (so one record of the largest, per rank)."""
    total, shares = sum(units), np.asarray(weights) / sum(weights)
    largest = max(v["tokens"] for s in sources for v in records(s).values())
    for got, share in zip(units, shares):
        assert abs(got - share * total) <= world * largest, (units, (np.array(units) / total).round(4).tolist())


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("rule", ["all", "first"])
def test_each_source_trains_its_share_and_every_record_once_a_pass(sources, world, rule):
    weights = [0.3, 0.5, 0.2]
    steps = run_ranks(world, lambda comm: list(batcher(comm, sources, config(), weights=weights, rule=rule,
                                                       num_epochs=2)))
    check_aligned(steps)
    units, times, first = trained(steps, sources, 2)
    every = {(v["source"], v["shard"], v["line"]) for s in sources for v in records(s).values() if not v["skip"]}
    for epoch in range(2):
        print(f"{rule}, {world} rank(s), epoch {epoch}: units {units[epoch]}, shares "
              f"{(np.array(units[epoch]) / sum(units[epoch])).round(4).tolist()}, {sum(times[epoch].values())} samples")
        check_shares(units[epoch], weights, world, sources)
        assert set(times[epoch]) <= every
        if rule == "all":  # every record at least once, its first pass exactly once
            assert set(times[epoch]) == every and all(first[epoch][key] == 1 for key in every)
        else:  # no record twice
            assert max(times[epoch].values()) == 1 and set(first[epoch]) == set(times[epoch])


def test_resume_mid_epoch_on_the_same_ranks_continues_the_very_plans(sources):
    weights = [0.3, 0.5, 0.2]

    def make(comm):
        return batcher(comm, sources, config(), weights=weights, num_epochs=2)

    whole = run_ranks(2, lambda comm: list(make(comm)))
    before, states = run_to_state(make, 2, stop_after=30)
    mixed = [state["reader"] for state in states]
    assert any(r["repeats"][0] for r in mixed), "stopped before the short source repeats"
    assert any(segment[1] > 0 for r in mixed for part in r["mixed"] for segment in part["segments"])

    def rank_main(comm):
        b = make(comm)
        b.load_state_dict(states[comm.rank])
        return list(b)

    after = run_ranks(2, rank_main)
    assert [[m.uids for s in before[r] + after[r] for m in s.micro_batches] for r in range(2)] == \
           [[m.uids for s in whole[r] for m in s.micro_batches] for r in range(2)]
    with pytest.raises(ValueError, match="resume it on 2 ranks"):
        redeal_states(states, 3)


def test_mix_by_samples_shares_the_samples_trained(sources):
    """mix_by samples: each source's share of the samples trained, within a record a rank."""
    weights = [0.5, 0.25, 0.25]
    steps = run_ranks(2, lambda comm: list(batcher(comm, sources, config(), weights=weights, mix_by="samples")))
    _, times, _ = trained(steps, sources, 1)
    count = Counter(key[0] for key in times[0].elements())
    total = sum(count.values())
    for name, weight in zip(SOURCES, weights):
        assert abs(count[name] - weight * total) <= 2 + 1, count  # one record a rank, and the total's
