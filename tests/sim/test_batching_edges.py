"""Edge cases of the round decision and the packers, over simulated ranks.

Windows in which every sample was skipped (the data layer returned None) or dropped over the cap,
baseline settings that can never form a micro-batch, quota closure that cuts a bin, and padded
bins for a model that cannot pack.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    check_aligned,
    check_caps,
    check_exact_once,
    check_label_tokens,
    roundtrip,
    simulated_labels,
)
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.cost import CostModel
from odb.batching.packer import Bin, OnlinePacker
from odb.batching.simulate import SimulatedFeed, run_ranks, simulate

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_with_skips(config: OdbConfig, lengths: list[int | None], world: int, *, num_epochs: int = 1,
                   timeout_s: float = 30.0):
    """Every rank's steps and batcher; ``None`` in ``lengths``: a record the data layer skips."""
    samples = [None if t is None else (t, 0) for t in lengths]

    def rank_main(comm):
        feed = SimulatedFeed(samples)
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=feed, num_epochs=num_epochs)
        return list(batcher), batcher

    results = run_ranks(world, rank_main, timeout_s=timeout_s)
    return [steps for steps, _ in results], [batcher for _, batcher in results]


def admitted(lengths: list[int | None], max_tokens: int, num_epochs: int = 1, over_cap: str = "truncate") -> Counter:
    size = len(lengths)
    return Counter(e * size + i for e in range(num_epochs) for i, t in enumerate(lengths)
                   if t is not None and (over_cap != "drop" or t <= max_tokens))


def round_bound(config: OdbConfig, lengths: list, world: int) -> int:
    """I3 (odb/batching/decide.py): static ``max(shard) + 1`` (fixed: ``2 * max(shard) + 1``), dynamic ``2N + 2``."""
    if config.sharding == "dynamic":
        return 2 * len(lengths) + 2
    shard = len(range(0, len(lengths), world))
    return 2 * shard + 1 if config.policy == "fixed" else shard + 1


# ---- 7: rounds in which no rank holds a bin ---------------------------------------------------

@pytest.mark.parametrize("sharding", ["static", "dynamic"])
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("kept", [8, 0])
def test_windows_skipped_on_every_rank_plan_zero_slots_and_end(sharding, gas, kept):
    # The run that died: 2 ranks, 40 chats, the last 32 without an assistant turn, window 4.
    lengths = [20 + i for i in range(kept)] + [None] * (40 - kept)
    config = OdbConfig(max_tokens=64, window=4, gas=gas, sharding=sharding, lookahead=4)
    steps, batchers = run_with_skips(config, lengths, 2, num_epochs=2)
    check_aligned(steps)
    check_exact_once(steps, admitted(lengths, 64, num_epochs=2))
    check_label_tokens(steps, simulated_labels(lengths), config.max_tokens)
    check_caps(steps, 64)
    assert sum(b.counts["skipped"] for b in batchers) == 2 * (40 - kept)
    assert batchers[0].round_index <= 2 * round_bound(config, lengths, 2)
    assert all(len(step.micro_batches) == gas for step in steps[0])


@SETTINGS
@given(st.lists(st.one_of(st.none(), st.integers(1, 150)), max_size=60), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 12), st.sampled_from(["static", "dynamic"]), st.sampled_from(["odb", "fixed"]),
       st.sampled_from(["truncate", "drop"]))
def test_invariants_hold_when_samples_are_skipped_or_dropped(lengths, world, gas, window, sharding, policy,
                                                             over_cap):
    window = max(window, gas, 3 if policy == "fixed" else 1)
    config = OdbConfig(max_tokens=100, window=window, gas=gas, sharding=sharding, policy=policy, batch_size=3,
                       lookahead=2, over_cap=over_cap)
    steps, batchers = run_with_skips(config, lengths, world)
    check_aligned(steps)
    check_exact_once(steps, admitted(lengths, 100, over_cap=over_cap))
    check_label_tokens(steps, simulated_labels(lengths), config.max_tokens)
    if policy == "odb":  # fixed batches take batch_size samples whatever their tokens (the baseline)
        check_caps(steps, 100)
    assert batchers[0].round_index <= round_bound(config, lengths, world)


@pytest.mark.parametrize("settings_, needle", [
    ({"policy": "fixed", "window": 4, "batch_size": 8}, "--policy fixed needs --window >= --batch_size"),
    ({"policy": "gmt", "sharding": "static", "mode": "quota", "quota": 10},
     "--policy gmt does not support --mode quota"),
    ({"policy": "bmt", "sharding": "static", "mode": "quota", "quota": 10},
     "--policy bmt does not support --mode quota"),
])
def test_baseline_settings_that_never_form_a_micro_batch_fail_at_start(settings_, needle):
    # Before: accepted, then IndexError in the round decision (no rank ever holds a bin).
    with pytest.raises(ValueError, match=needle):
        OdbConfig(max_tokens=64, **settings_)


# ---- 8: quota mode with nothing to train ------------------------------------------------------

@pytest.mark.parametrize("sharding,cause", [("static", "skipped"), ("dynamic", "skipped"), ("dynamic", "dropped"),
                                            ("static", "dropped")])
def test_quota_mode_stops_on_every_rank_when_a_full_pass_admits_nothing(sharding, cause):
    samples = [None] * 30 if cause == "skipped" else [(80, 0)] * 30  # over the cap of 64 under 'drop'
    config = OdbConfig(max_tokens=64, window=4, lookahead=4, sharding=sharding, mode="quota", quota=10,
                       over_cap="drop")

    def rank_main(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples))
        try:
            list(batcher)
        except ValueError as err:
            return str(err)
        return "ended without an error"

    messages = run_ranks(3, rank_main, timeout_s=10)
    assert len(set(messages)) == 1, messages  # every rank, the same decision
    assert "a full pass over the data admitted no sample" in messages[0]
    figure = "skipped (the data layer returned None), 0 dropped" if cause == "skipped" else "0 skipped"
    assert figure in messages[0] and "--over_cap truncate" in messages[0]


@SETTINGS
@given(st.lists(st.one_of(st.none(), st.integers(1, 150)), min_size=1, max_size=40), st.integers(1, 4),
       st.integers(1, 3), st.integers(1, 12), st.sampled_from(["static", "dynamic"]), st.integers(1, 90))
def test_quota_mode_with_skipped_samples_trains_exactly_the_quota_or_stops(lengths, world, gas, window,
                                                                            sharding, quota):
    config = OdbConfig(max_tokens=100, window=max(window, gas), gas=gas, sharding=sharding, lookahead=2,
                       mode="quota", quota=quota, over_cap="drop")
    shard_sizes = [len(range(r, len(lengths), world)) for r in range(world)]
    if sharding == "static" and 0 in shard_sizes:
        return  # an empty static shard may leave more than the last step with dummies
    if all(t is None or t > 100 for t in lengths):
        with pytest.raises(ValueError, match="a full pass over the data admitted no sample"):
            run_with_skips(config, lengths, world, timeout_s=20)
        return
    steps, _ = run_with_skips(config, lengths, world, timeout_s=20)
    check_aligned(steps)
    check_label_tokens(steps, simulated_labels(lengths), config.max_tokens)
    check_caps(steps, 100)
    trained = [u for rank_steps in steps for p in rank_steps for m in p.micro_batches for u in m.uids]
    assert len(trained) == quota and len(set(trained)) == quota


# ---- 13: the quota cut's tokens and cost ------------------------------------------------------

@pytest.mark.parametrize("extra", [{"attn_coef": 0.01}, {"policy": "fixed", "batch_size": 3, "sharding": "static"},
                                   {"pad_rows": True, "attn_coef": 0.01}])
@pytest.mark.parametrize("quota", [37, 50, 61])
def test_quota_cut_step_reports_the_kept_samples_tokens_and_costs(extra, quota):
    lengths = [(t * 37) % 90 + 5 for t in range(40)]
    config = OdbConfig(max_tokens=128, window=12, gas=2, mode="quota", quota=quota, **extra)
    model = CostModel.from_config(config)
    result = simulate(config, [(t, 0) for t in lengths], 3)
    steps = result.steps
    check_aligned(steps)
    check_label_tokens(steps, simulated_labels(lengths), config.max_tokens)
    for position in range(len(steps[0])):
        for r, rank_steps in enumerate(steps):
            plan = rank_steps[position]
            for m, micro in enumerate(plan.micro_batches):
                assert plan.rank_tokens[m][r] == micro.tokens
                cost = Bin.of(micro.samples, model, micro.padded).cost if micro.samples else 0
                assert plan.rank_costs[m][r] == cost
    trained = [m for rank_steps in steps for p in rank_steps for m in p.micro_batches]
    assert sum(len(m.samples) for m in trained) == quota
    assert sum(sum(map(sum, p.rank_tokens)) for p in steps[0]) == sum(m.tokens for m in trained)


# ---- 4: padded bins for a model that cannot pack ----------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 300), st.sampled_from([0, 0, 4, 16])), min_size=1, max_size=120),
       st.integers(300, 600), st.floats(0.0, 1.0), st.booleans())
def test_padded_online_packer_keeps_every_sample_within_rows_times_longest(samples, cap, min_fill, exhausted):
    model = CostModel(max_tokens=cap, max_patches=40)
    packer = OnlinePacker(model, min_fill=min_fill, max_carry=0.5, padded=True)
    packer.add([model.measure(i, t, t - 1, p)[0] for i, (t, p) in enumerate(samples)])
    ready = packer.pack(window=len(samples), is_exhausted=exhausted)
    assert Counter(s.uid for b in packer.bins for s in b.samples) == Counter(range(len(samples)))
    for b in packer.bins:
        assert b.padded and b.materialized == len(b.samples) * b.longest <= cap and b.patches <= 40
        assert b.cost == model.padded_cost(len(b.samples), b.longest)
    if not exhausted:
        assert sum(len(b.samples) for b in packer.bins[ready:]) <= 0.5 * len(samples)


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_pad_rows_bins_hold_rows_times_longest_under_the_cap(sharding):
    lengths = [((i * 7919) % 400) + 3 for i in range(300)]
    config = OdbConfig(max_tokens=1024, window=32, gas=2, lookahead=8, sharding=sharding, pad_rows=True)
    samples = [(t, 0) for t in lengths]
    full = simulate(config, samples, 3, num_epochs=2).steps
    check_aligned(full)
    check_exact_once(full, Counter(range(600)))
    check_label_tokens(full, simulated_labels(lengths), config.max_tokens)
    check_caps(full, 1024)
    micro = [m for rank_steps in full for p in rank_steps for m in p.micro_batches if m.samples]
    assert all(m.padded and m.materialized == len(m.samples) * max(s.tokens for s in m.samples) <= 1024
               for m in micro)
    assert sum(m.materialized for m in micro) > sum(m.tokens for m in micro)  # padding is counted
    # I6: a state taken mid-run reproduces the rest of the plan (padded bins restored as padded)
    k = len(full[0]) // 3
    states = [None] * 3

    def first_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=300, feed=SimulatedFeed(samples), num_epochs=2)
        steps = [step for _, step in zip(range(k), batcher)]
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    def second_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=300, feed=SimulatedFeed(samples), num_epochs=2)
        batcher.load_state_dict(states[comm.rank])
        return list(batcher)

    head, tail = run_ranks(3, first_part), run_ranks(3, second_part)
    assert [h + t for h, t in zip(head, tail)] == full


def test_a_state_written_before_pad_rows_existed_still_loads():
    samples = [(5, 0)] * 10
    config = OdbConfig(max_tokens=16, window=4)
    states = run_ranks(2, lambda comm: OnlineBatcher(config, comm, dataset_size=10,
                                                     feed=SimulatedFeed(samples)).state_dict())
    for state in states:
        del state["config"]["pad_rows"]

    def load(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=10, feed=SimulatedFeed(samples))
        batcher.load_state_dict(states[comm.rank])
        return list(batcher)

    assert run_ranks(2, load) == simulate(config, samples, 2).steps
    padded = OdbConfig(max_tokens=16, window=4, pad_rows=True)
    with pytest.raises(ValueError, match=r"settings differ from the checkpoint in \['pad_rows'\]"):
        run_ranks(2, lambda comm: OnlineBatcher(padded, comm, dataset_size=10, feed=SimulatedFeed(samples))
                  .load_state_dict(states[comm.rank]))


# ---- the Feed: lazy dealing, resume without patching queues, forgotten samples ----------------

class LoggingFeed(SimulatedFeed):
    """Remembers every uid dealt, in order."""

    def __init__(self, samples):
        super().__init__(samples)
        self.dealt = []

    def deal(self, uids):
        self.dealt.extend(uids)
        super().deal(uids)


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_construction_deals_nothing_and_a_resume_deals_only_the_states_pending(sharding):
    samples = [((i * 37) % 90 + 5, 0) for i in range(120)]
    config = OdbConfig(max_tokens=128, window=8, gas=2, lookahead=4, sharding=sharding)
    full = simulate(config, samples, 3, num_epochs=2).steps
    states = [None] * 3

    def first_part(comm):
        feed = LoggingFeed(samples)
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=feed, num_epochs=2)
        assert feed.dealt == []  # the first deal waits for the first round
        steps = [step for _, step in zip(range(5), batcher)]
        assert feed.dealt
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    def second_part(comm):
        feed = LoggingFeed(samples)  # a fresh process: nothing dealt, nothing to clear
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=feed, num_epochs=2)
        batcher.load_state_dict(states[comm.rank])
        pending = states[comm.rank]["pending"]
        assert feed.dealt == [] and set(batcher.held_uids()).isdisjoint(pending)
        steps = list(batcher)
        assert pending and feed.dealt[:len(pending)] == pending  # dealt first, in order, at the next round
        return steps

    head, tail = run_ranks(3, first_part), run_ranks(3, second_part)
    assert [h + t for h, t in zip(head, tail)] == full


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_a_finished_run_resumed_with_more_epochs_trains_them_as_one_longer_run_would(sharding):
    samples = [((i * 53) % 120 + 3, 0) for i in range(90)]
    config = OdbConfig(max_tokens=160, window=10, gas=2, lookahead=3, sharding=sharding)
    full = simulate(config, samples, 2, num_epochs=2).steps
    states = [None] * 2

    def first_epoch(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples))
        steps = list(batcher)
        assert batcher.is_done
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    def more_epochs(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples), num_epochs=2)
        batcher.load_state_dict(states[comm.rank])
        assert not batcher.is_done and batcher.epoch == 1
        return list(batcher)

    head, tail = run_ranks(2, first_epoch), run_ranks(2, more_epochs)
    assert [h + t for h, t in zip(head, tail)] == full


def test_the_feed_forgets_exactly_the_samples_that_will_not_train():
    lengths = [None if i % 5 == 0 else (300 if i % 7 == 0 else 20 + i) for i in range(70)]
    config = OdbConfig(max_tokens=200, window=6, lookahead=2, over_cap="drop")
    samples = [None if t is None else (t, 0) for t in lengths]
    feeds = [SimulatedFeed(samples) for _ in range(3)]

    def rank_main(comm):
        return list(OnlineBatcher(config, comm, dataset_size=len(samples), feed=feeds[comm.rank]))

    steps = run_ranks(3, rank_main)
    lost = {i for i, t in enumerate(lengths) if t is None or t > 200}
    check_exact_once(steps, Counter(i for i in range(len(lengths)) if i not in lost))
    assert Counter(u for feed in feeds for u in feed.forgotten) == Counter(lost)
    assert all(not feed.queue for feed in feeds)  # every dealt uid was fetched
