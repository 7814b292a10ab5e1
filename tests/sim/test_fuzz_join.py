"""Randomized fuzzer, join mode: random settings (window, gas, lookahead, min_fill, max_carry,
sharding, every policy, pad_rows, over_cap truncate / drop / sequence_parallel, a patch cap, the
attention term), 0-300 records with skipped ones and ones over the caps, 1-8 ranks, 1-2 epochs.
Against oracles from the records alone (tests/fuzzing.py): every admitted record trains exactly
once per epoch (I2), the skipped and dropped ones are counted, every rank runs the same steps of
GAS micro-batches (I1), each sample holds its record cut to the cap and N_step is its step's
labels over all ranks (I4), no micro-batch is over a cap (I5; the fixed baseline ignores the
budget by design), every run ends within the stated rounds (I3), and none hangs (each run is
bounded by a timeout). Also sequence-parallel groups (SequenceGroups), a rank whose data fails at
a random fetch, and over_cap 'error': every process stops, none waits."""

import numpy as np
import pytest

from conftest import check_aligned, check_caps
from fuzzing import (
    TIMEOUT_S,
    batcher_of,
    check_samples,
    expected_uids,
    long_cap,
    plans,
    random_config,
    random_lengths,
    trained,
)
from odb.batching.align import SequenceGroups
from odb.batching.config import OdbConfig
from odb.batching.cost import OverCapError
from odb.batching.simulate import SimulatedFeed, run_ranks

SEEDS = 600  # about 10 s here


def instance(seed: int):
    rng = np.random.default_rng(seed)
    config = random_config(rng)
    lengths = random_lengths(rng, config.max_tokens, int(rng.choice([10, 120, 300])))
    return config, lengths, int(rng.choice([1, 2, 3, 4, 5, 6, 8])), int(rng.integers(1, 3))


def check_run(config, lengths, world, epochs):
    out = run_ranks(world, lambda comm: (lambda b: (list(b), b))(batcher_of(config, lengths, epochs)(comm)),
                    timeout_s=TIMEOUT_S)
    steps, batchers = [o[0] for o in out], [o[1] for o in out]
    check_aligned(steps)
    assert all(len(step.micro_batches) == config.gas for rank_steps in steps for step in rank_steps)
    uids, dropped, skipped = expected_uids(config, lengths, epochs, world)
    got = trained(steps)
    assert got == uids, f"missing {sorted((uids - got).elements())[:10]}, extra {sorted((got - uids).elements())[:10]}"
    counts = {k: sum(b.counts[k] for b in batchers) for k in ("skipped", "dropped")}
    assert counts == {"skipped": skipped, "dropped": dropped}
    check_samples(steps, lengths, long_cap(config, world))
    if config.over_cap != "sequence_parallel" and config.policy != "fixed":
        check_caps(steps, config.max_tokens, config.max_patches)
        assert all(m.materialized <= config.max_tokens for r in steps for s in r for m in s.micro_batches)
    rounds = batchers[0].round_index
    if config.sharding == "dynamic":
        assert rounds <= epochs * (2 * len(lengths) + 2), rounds
    elif config.over_cap != "sequence_parallel":  # (a long bin may wait for its group: no static bound)
        shard = -(-len(lengths) // world)
        assert rounds <= epochs * ((2 * shard + 1) if config.policy == "fixed" else shard + 1), rounds


@pytest.mark.parametrize("chunk", range(4))
def test_random_settings_keep_every_invariant(chunk):
    for seed in range(chunk * SEEDS // 4, (chunk + 1) * SEEDS // 4):
        config, lengths, world, epochs = instance(seed)
        try:
            check_run(config, lengths, world, epochs)
        except Exception as err:
            raise AssertionError(f"seed {seed}: {world} ranks, {epochs} epochs, {len(lengths)} records, "
                                 f"{config}") from err


class FailsAt(SimulatedFeed):
    """A feed whose ``at``-th fetch raises (a dead DataLoader worker, a bad record under strict)."""

    def __init__(self, lengths, at):
        super().__init__(lengths)
        self.at, self.calls = at, 0

    def fetch(self, uids):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("worker died")
        return super().fetch(uids)


def groups_instance(seed: int):
    rng = np.random.default_rng(10_000 + seed)
    config = random_config(rng, sharding="dynamic", policy="odb")
    return (config, random_lengths(rng, config.max_tokens, 100), int(rng.integers(1, 5)), int(rng.integers(1, 4)),
            int(rng.integers(1, 3)), rng)


@pytest.mark.parametrize("seed", range(0, 150, 15))
def test_sequence_groups_a_failing_rank_and_over_cap_errors_at_random(seed):
    """Per seed 15 instances: S processes a group run the same plans and the groups train every
    record once; a process whose feed fails at a random fetch stops every process with its
    error; over_cap 'error' stops every rank with OverCapError where a record is over the cap."""
    for seed in range(seed, seed + 15):
        config, lengths, groups, size, epochs, rng = groups_instance(seed)
        make = batcher_of(config, lengths, epochs)
        steps = run_ranks(groups * size, lambda comm: list(make(SequenceGroups(comm, size))), timeout_s=TIMEOUT_S)
        for g in range(groups):
            assert all(plans(steps[g * size:g * size + 1]) == plans(steps[p:p + 1])
                       for p in range(g * size, (g + 1) * size)), f"seed {seed}: group {g}'s processes differ"
        check_aligned(steps[::size])
        assert trained(steps[::size]) == expected_uids(config, lengths, epochs, groups)[0], f"seed {seed}"

        victim, at = int(rng.integers(0, groups * size)), int(rng.integers(1, 6))

        def failing(comm):
            member, comm = comm.rank, SequenceGroups(comm, size)
            feed = FailsAt(lengths, at) if member == victim else SimulatedFeed(lengths)
            batcher = make(comm)
            batcher.feed = feed
            list(batcher)
            return getattr(feed, "calls", None)

        try:
            calls = run_ranks(groups * size, failing, timeout_s=TIMEOUT_S)[victim]
            assert calls < at, f"seed {seed}: the failing fetch happened and the run went on"
        except RuntimeError as err:
            assert "worker died" in str(err), f"seed {seed}: {err}"

        if any(e is not None and e[0] > config.max_tokens for e in lengths):
            strict = OdbConfig(**{**config.to_dict(), "over_cap": "error"})
            with pytest.raises(OverCapError, match="raise the cap or set over_cap"):
                run_ranks(groups, lambda comm: list(batcher_of(strict, lengths, epochs)(comm)), timeout_s=TIMEOUT_S)
