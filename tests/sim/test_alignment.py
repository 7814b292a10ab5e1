"""DGAP invariants over simulated ranks (one process, one thread per rank)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_aligned, check_caps, check_exact_once, check_label_tokens, roundtrip, simulated_labels
from odb.batching.align import Aligner, SettingsMismatch, SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.cost import OverCapError
from odb.batching.deal import waterfill
from odb.batching.simulate import SimulatedFeed, run_ranks, simulate
from odb.batching.wire import PER_SAMPLE, PROPOSAL_SCALARS, Layout, Proposal, proposal_layout

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected_uids(num_samples: int, num_epochs: int = 1, skip: set[int] = frozenset()) -> Counter:
    return Counter(e * num_samples + i for e in range(num_epochs) for i in range(num_samples) if i not in skip)


@st.composite
def static_shards(draw):
    """Explicit per-rank shards, including empty ranks and ranks far larger than the others."""
    world = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.sampled_from([0, 0, 1, 2, 5, 17, 60, 300]), min_size=world, max_size=world))
    lengths = draw(st.lists(st.integers(1, 120), min_size=sum(sizes), max_size=sum(sizes)))
    shards, start = [], 0
    for size in sizes:
        shards.append(list(range(start, start + size)))
        start += size
    return lengths, shards


@SETTINGS
@given(static_shards(), st.integers(1, 4), st.integers(1, 40), st.integers(100, 300), st.integers(1, 2))
def test_invariants_on_uneven_static_shards(data, gas, window, max_tokens, epochs):
    lengths, shards = data
    config = OdbConfig(max_tokens=max_tokens, window=max(window, gas), gas=gas, sharding="static")
    result = simulate(config, [(t, 0) for t in lengths], len(shards), shards=shards, num_epochs=epochs)
    check_aligned(result.steps)
    check_exact_once(result.steps, expected_uids(len(lengths), epochs))
    check_label_tokens(result.steps, simulated_labels(lengths), config.max_tokens)
    check_caps(result.steps, max_tokens)
    # I3: every round trains at least one sample of every rank that still has input, so an epoch
    # takes at most (largest shard + 1) rounds (the +1 is the drain round).
    assert result.batchers[0].round_index <= epochs * (max(len(s) for s in shards) + 1)
    assert all(len(step.micro_batches) == gas for step in result.steps[0])


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 400), st.sampled_from([0, 0, 0, 16, 64])), max_size=400),
       st.integers(1, 6), st.integers(1, 3), st.integers(1, 64), st.integers(0, 16),
       st.integers(300, 1000), st.integers(1, 2))
def test_invariants_with_dynamic_dealing(lengths, world, gas, window, lookahead, max_tokens, epochs):
    config = OdbConfig(max_tokens=max_tokens, window=max(window, gas), gas=gas, lookahead=lookahead,
                       max_patches=100)
    result = simulate(config, lengths, world, num_epochs=epochs)
    dropped = {i for i, (_, p) in enumerate(lengths) if p > 100}
    check_aligned(result.steps)
    check_exact_once(result.steps, expected_uids(len(lengths), epochs, skip=dropped))
    check_label_tokens(result.steps, simulated_labels(lengths), config.max_tokens)
    check_caps(result.steps, max_tokens, max_patches=100)
    assert sum(b.counts["dropped"] for b in result.batchers) == epochs * len(dropped)
    # I3: a round either trains a bin or deals an index: at most 2N + 1 rounds (+1 drain) an epoch.
    assert result.batchers[0].round_index <= epochs * (2 * len(lengths) + 2)


@SETTINGS
@given(st.lists(st.integers(1, 300), min_size=1, max_size=200), st.integers(1, 5), st.integers(1, 3),
       st.integers(1, 50), st.integers(1, 700), st.booleans())
def test_quota_mode_closes_at_exactly_the_quota(lengths, world, gas, window, quota, static):
    static = static and len(lengths) >= world  # a static shard must not be empty for this property
    config = OdbConfig(max_tokens=300, window=max(window, gas), gas=gas, mode="quota", quota=quota,
                       sharding="static" if static else "dynamic")
    result = simulate(config, [(t, 0) for t in lengths], world)
    check_aligned(result.steps)
    check_label_tokens(result.steps, simulated_labels(lengths), config.max_tokens)
    trained = [u for s in result.steps for p in s for m in p.micro_batches for u in m.uids]
    assert len(trained) == quota and len(set(trained)) == quota
    # only the last step may hold dummies
    for rank_steps in result.steps:
        assert all(not m.is_dummy for p in rank_steps[:-1] for m in p.micro_batches)


@SETTINGS
@given(st.lists(st.integers(1, 200), min_size=1, max_size=300), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 40), st.booleans(), st.data())
def test_resume_reproduces_the_remaining_plan(lengths, world, gas, window, static, data):
    config = OdbConfig(max_tokens=256, window=max(window, gas), gas=gas,
                       sharding="static" if static else "dynamic")
    samples = [(t, 0) for t in lengths]
    full = simulate(config, samples, world, num_epochs=2).steps
    k = data.draw(st.integers(0, len(full[0])))
    states = [None] * world

    def first_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples), num_epochs=2)
        steps = [step for _, step in zip(range(k), batcher)]
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    def second_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples), num_epochs=2)
        before = roundtrip(states[comm.rank])
        batcher.load_state_dict(states[comm.rank])
        assert states[comm.rank] == before  # loading does not mutate its input
        return list(batcher)

    head = run_ranks(world, first_part)
    tail = run_ranks(world, second_part)
    assert [h + t for h, t in zip(head, tail)] == full


def test_state_from_another_world_size_or_version_is_refused():
    samples = [(5, 0)] * 10
    config = OdbConfig(max_tokens=16, window=4)
    states = run_ranks(2, lambda comm: OnlineBatcher(config, comm, dataset_size=10,
                                                     feed=SimulatedFeed(samples)).state_dict())

    def load(state):
        def fn(comm):
            OnlineBatcher(config, comm, dataset_size=10, feed=SimulatedFeed(samples)).load_state_dict(state)
        return fn

    with pytest.raises(ValueError, match="world_size=2, this run has 3; deal every rank's state to this world"):
        run_ranks(3, load(states[0]))
    with pytest.raises(ValueError, match="version 99"):
        run_ranks(1, load({**states[0], "version": 99}))
    other = OdbConfig(max_tokens=32, window=4)
    with pytest.raises(ValueError, match=r"settings differ from the checkpoint in \['max_tokens'\]"):
        run_ranks(2, lambda comm: OnlineBatcher(other, comm, dataset_size=10, feed=SimulatedFeed(samples))
                  .load_state_dict(states[comm.rank]))


def test_mismatched_settings_fail_at_start_on_every_rank_naming_the_keys():
    samples = [(5, 0)] * 10
    errors = []

    def fn(comm):
        config = OdbConfig(max_tokens=16 if comm.rank == 0 else 32, gas=1 + comm.rank % 2, window=4)
        try:
            OnlineBatcher(config, comm, dataset_size=10, feed=SimulatedFeed(samples))
        except SettingsMismatch as err:
            errors.append(str(err))

    run_ranks(3, fn)
    assert len(errors) == 3
    # gas differs on rank 1 (1 + 1 % 2 = 2), max_tokens on ranks 1 and 2
    assert all("'gas': rank(s) [1] differ" in e and "'max_tokens': rank(s) [1, 2] differ" in e
               and "start every rank with the same" in e for e in errors)


def test_a_sample_over_the_cap_under_error_policy_stops_with_its_id():
    config = OdbConfig(max_tokens=16, window=4, over_cap="error")
    with pytest.raises(OverCapError, match="sample 3 has 40 tokens > max_tokens=16"):
        simulate(config, [(5, 0), (5, 0), (5, 0), (40, 0)], 2, timeout_s=30)


def test_an_empty_sample_is_a_clear_error():
    with pytest.raises(ValueError, match="sample 1 is empty"):
        simulate(OdbConfig(max_tokens=16, window=4), [(5, 0), (0, 0)], 1, timeout_s=30)


def test_one_collective_per_round():
    result = simulate(OdbConfig(max_tokens=64, window=8, gas=2), [(t % 50 + 1, 0) for t in range(300)], 4)
    for batcher in result.batchers:
        assert batcher.aligner.comm.num_collectives == batcher.round_index + 1  # + the start check


@SETTINGS
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=40), st.integers(1, 500), st.integers(0, 400),
       st.data())
def test_waterfill_equals_dealing_one_by_one_to_the_least_loaded(loads, unit, total, data):
    caps = data.draw(st.lists(st.integers(0, 60), min_size=len(loads), max_size=len(loads)))
    expected, current = [0] * len(loads), list(loads)
    for _ in range(min(total, sum(caps))):
        r = min((r for r in range(len(loads)) if expected[r] < caps[r]), key=lambda r: (current[r], r))
        expected[r] += 1
        current[r] += unit
    assert waterfill(np.array(loads), unit, total, np.array(caps)) == expected


@SETTINGS
@given(st.lists(st.lists(st.integers(1, 50), max_size=6), min_size=1, max_size=5), st.booleans())
def test_packed_rows_of_different_lengths_unpack_to_what_the_full_vectors_decode_to(bins, quota):
    """Each rank's bins (their sample counts) -> its proposal; the rows that travel (each array cut
    to what the rank uses, lengths differing by rank) read back as the whole vectors decode,
    each array cut to the widest rank's use."""
    proposals = []
    for counts in bins:
        per_sample = sum(counts)
        proposals.append(Proposal(
            is_fatal=False, is_exhausted=False, num_ready=len(counts), window_samples=per_sample, window_cost=7,
            num_pending=1, observed_cost=3, observed_cost_sq=9, observed_samples=1, is_first_pass_open=False,
            num_skipped=0, num_dropped=0, bin_costs=[c * 3 for c in counts], bin_samples=counts,
            bin_tokens=[c * 2 for c in counts], bin_labels=[c * 2 - 1 for c in counts],
            **({name: list(range(1, per_sample + 1)) for name in PER_SAMPLE} if quota else {})))
    layout = proposal_layout(6, 300, per_sample_costs=quota)
    full = layout.decode(np.stack([layout.encode(**p.values()) for p in proposals]))
    rows = [layout.pack(layout.encode(**p.values())) for p in proposals]
    assert len({len(r) for r in rows}) == len({len(c) for c in bins}) or quota
    fields = layout.unpack(np.concatenate(rows), np.array([len(r) for r in rows]))
    for name, value in full.items():
        width = fields[name].shape[-1] if value.ndim > 1 else None
        assert np.array_equal(fields[name], value[:, :width] if width is not None else value), name
        if width is not None:
            assert not value[:, width:].any(), name  # (nothing but room was left behind)
    with pytest.raises(ValueError, match="do not fit this layout"):
        layout.unpack(np.concatenate(rows + [np.zeros(1, dtype=np.int64)]),
                      np.array([len(r) for r in rows[:-1]] + [len(rows[-1]) + 1]))


def test_a_row_shorter_than_its_own_lengths_say_is_refused_naming_the_ranks():
    layout = Layout(scalars=("n",), arrays={"a": 4}, lengths={"a": "n"})
    first = layout.pack(layout.encode(n=2, a=[1, 2]))
    assert first.tolist() == [2, 1, 2]
    for rows, lengths in (([*first, 3, 7], [3, 2]), ([3, 7, *first], [2, 3])):
        with pytest.raises(ValueError, match="do not fit this layout"):
            layout.unpack(np.array(rows), np.array(lengths))
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):
        layout.unpack_matrix(np.array([[1, 5], [4, 1]]))
    assert layout.unpack_matrix(np.array([[2, 1, 2], [1, 9, 0]]))["a"].tolist() == [[1, 2], [9, 0]]


@pytest.mark.parametrize("quota", [False, True])
def test_a_proposal_decodes_to_what_it_encoded(quota):
    per_sample = {"sample_labels": [8, 7, 6], "sample_tokens": [9, 8, 7], "sample_costs": [10, 9, 8]} if quota else {}
    proposal = Proposal(is_fatal=False, is_exhausted=True, num_ready=1, window_samples=3, window_cost=27,
                        num_pending=4, observed_cost=100, observed_cost_sq=4000, observed_samples=6,
                        is_first_pass_open=True, num_skipped=2, num_dropped=1, bin_costs=[19, 8],
                        bin_samples=[2, 1], bin_tokens=[17, 7], bin_labels=[15, 6], **per_sample)
    layout = proposal.layout(max_bins=4, max_samples=5)
    assert layout.size == len(PROPOSAL_SCALARS) + 4 * 4 + (1 + 3 * 5 if quota else 0)  # (num_binned, per sample)
    fields = layout.decode(np.stack([layout.encode(**proposal.values())] * 2))  # two ranks
    for name, value in proposal.values().items():
        width = len(value) if isinstance(value, list) else None
        decoded = fields[name][1, :width] if width is not None else fields[name][1]
        assert np.array_equal(decoded, value), name
    assert fields["num_bins"].tolist() == [2, 2]
    with pytest.raises(ValueError, match="holds 1 values, got 2"):
        proposal.layout(max_bins=1, max_samples=5).encode(**proposal.values())


def test_reports_of_different_lengths_are_refused_unless_ragged_and_so_are_different_settings_counts():
    def rank_main(comm):
        aligner = Aligner(comm)
        ragged = aligner.gather_reports(np.arange(comm.rank + 1), ragged=True)
        with pytest.raises(RuntimeError, match="different lengths"):
            aligner.gather_reports(np.arange(comm.rank + 1))
        with pytest.raises(SettingsMismatch, match="different numbers of settings"):
            aligner.check_settings({"a": 1, **({"b": 2} if comm.rank else {})})
        return ragged.tolist()

    assert SimulatedGroup(2).run(rank_main) == [[[0, 0], [0, 1]]] * 2
