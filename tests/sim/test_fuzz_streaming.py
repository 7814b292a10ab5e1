"""Randomized fuzzer, streaming sources: 1-8 JSONL shards of 0-60 records written here (blank
lines, files without their last newline, 10% of records skipped), random settings (window, gas,
lookahead, min_fill, policy odb or fixed, over_cap truncate or drop, the shuffle buffer), 1-4
ranks, 1-2 passes, each rank reading its own shards. The oracle is the files split into lines by
Python: every admitted line trains exactly once per pass, also over resumes at random steps on
the same ranks (which plan what the uninterrupted run did) and a chain of re-deals (W -> W1 ->
W2) by shard and byte offset; the ranks stay aligned."""

from collections import Counter

import numpy as np
import pytest

from conftest import check_aligned
from fuzzing import TIMEOUT_S, batcher_of, plans, redeal_chain, run_states, write_shards
from odb.batching.config import OdbConfig
from odb.data.streaming import ShardReader, StreamShards


class Sizes:
    """What SimulatedFeed reads per uid: the record's own ``tokens`` (None: the data layer skips it)."""

    def __init__(self, shards):
        self.shards = shards

    def __len__(self):
        return len(self.shards)

    def __getitem__(self, index):
        tokens = self.shards.get(index).value["tokens"]
        return None if tokens is None else (tokens, 0)


def check_stream(seed, folder):
    rng = np.random.default_rng(seed)
    records = write_shards(folder, rng)
    try:
        shards = StreamShards(folder)
    except ValueError:  # every shard empty: refused at start (tests/unit/test_streaming_source.py)
        return
    gas = int(rng.integers(1, 4))
    config = OdbConfig(max_tokens=int(rng.integers(100, 600)), window=int(rng.integers(gas, 30)), gas=gas,
                       lookahead=int(rng.integers(0, 12)), sharding="static", cost_model="manual",
                       seed=int(rng.integers(0, 9)), policy=str(rng.choice(["odb", "odb", "fixed"])),
                       batch_size=int(rng.integers(1, gas + 1)), min_fill=float(rng.choice([0.0, 0.99])),
                       over_cap=str(rng.choice(["truncate", "drop"])))
    buffer_size, passes, world = int(rng.integers(1, 20)), int(rng.integers(1, 3)), int(rng.integers(1, 5))
    make = batcher_of(config, Sizes(shards), passes,
                      reader=lambda: ShardReader(shards, seed=config.seed, buffer_size=buffer_size, chunk_bytes=64))

    expected = Counter((p, s, line) for p in range(passes) for (s, line), t in records.items()
                       if t is not None and not (config.over_cap == "drop" and t > config.max_tokens))

    def lines_trained(steps):
        out = Counter()
        for uid in (u for rank_steps in steps for s in rank_steps for m in s.micro_batches for u in m.uids):
            value = shards.get(uid % len(shards)).value
            out[(uid // len(shards), value["shard"], value["line"])] += 1
        return out

    full, states, _ = run_states(make, world)
    check_aligned(full)
    assert lines_trained(full) == expected
    for k in sorted(set(rng.integers(0, len(full[0]) + 1, 3).tolist())):
        tail, _, _ = run_states(make, world, [rank_states[k] for rank_states in states])
        assert plans(tail) == plans([rank_steps[k:] for rank_steps in full]), f"a resume after step {k} differs"
    steps, _ = redeal_chain(make, full, states, [int(w) for w in rng.integers(1, 6, 2)], rng)
    got = lines_trained(steps)
    assert got == expected, (sorted((expected - got).elements())[:5], sorted((got - expected).elements())[:5])


@pytest.mark.parametrize("chunk", range(4))
def test_random_shards_train_every_line_once_a_pass_across_resumes_and_redeals(chunk, tmp_path):
    for seed in range(chunk * 35, (chunk + 1) * 35):
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        try:
            check_stream(seed, folder)
        except Exception as err:
            raise AssertionError(f"seed {seed} (timeout {TIMEOUT_S} s a run)") from err
