"""Resume on another number of ranks (odb.batching.redeal): a run stopped after any step on W1
simulated ranks and continued on W2 trains every sample of every epoch exactly once over both
parts, aligned, with its steps numbered on; the oracle is the sample set itself."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_aligned, check_label_tokens, roundtrip, simulated_labels
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stop_and_redeal(config, samples, old_world, new_world, k, epochs):
    """k steps on ``old_world`` ranks, then the rest on ``new_world``: (head, tail) steps per rank."""
    states = [None] * old_world

    def first_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples),
                                num_epochs=epochs)
        steps = [step for _, step in zip(range(k), batcher)]
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    head = run_ranks(old_world, first_part)
    before = roundtrip(states)
    dealt = redeal_states(states, new_world)
    assert states == before  # the input is not touched

    def second_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples),
                                num_epochs=epochs)
        batcher.load_state_dict(roundtrip(dealt[comm.rank]))
        return list(batcher)

    return head, run_ranks(new_world, second_part)


def uids(steps):
    return Counter(u for rank in steps for s in rank for m in s.micro_batches for u in m.uids)


@SETTINGS
@given(st.lists(st.integers(1, 200), min_size=1, max_size=250), st.integers(1, 4), st.integers(1, 4),
       st.integers(1, 3), st.integers(1, 40), st.booleans(), st.data())
def test_join_mode_trains_every_sample_of_every_epoch_exactly_once_across_the_change(
        lengths, old_world, new_world, gas, window, static, data):
    config = OdbConfig(max_tokens=256, window=max(window, gas), gas=gas, sharding="static" if static else "dynamic")
    samples = [(t, 0) for t in lengths]
    k = data.draw(st.integers(0, 3 * len(lengths)), label="k")
    head, tail = stop_and_redeal(config, samples, old_world, new_world, k, epochs=2)
    assert uids(head) + uids(tail) == Counter(range(2 * len(samples)))
    check_aligned(tail)
    check_label_tokens(tail, simulated_labels(samples), config.max_tokens)
    if tail[0]:
        assert tail[0][0].step == len(head[0])  # steps numbered on, none skipped


@SETTINGS
@given(st.lists(st.integers(1, 120), min_size=1, max_size=120), st.integers(1, 4), st.integers(1, 4),
       st.integers(1, 3), st.integers(1, 30), st.integers(1, 300), st.data())
def test_quota_mode_trains_exactly_the_quota_across_the_change(lengths, old_world, new_world, gas, window, quota,
                                                               data):
    config = OdbConfig(max_tokens=256, window=max(window, gas), gas=gas, mode="quota", quota=quota)
    samples = [(t, 0) for t in lengths]
    k = data.draw(st.integers(0, quota), label="k")
    head, tail = stop_and_redeal(config, samples, old_world, new_world, k, epochs=1)
    assert sum(uids(head).values()) + sum(uids(tail).values()) == quota
    check_aligned(tail)


def test_what_cannot_be_redealt_is_refused_naming_the_fix():
    samples = [(5, 0)] * 10
    static_quota = OdbConfig(max_tokens=16, window=4, sharding="static", mode="quota", quota=20)
    states = run_ranks(2, lambda comm: OnlineBatcher(static_quota, comm, dataset_size=10,
                                                     feed=SimulatedFeed(samples)).state_dict())
    with pytest.raises(ValueError, match="static sharding in quota mode .* use sharding 'dynamic'"):
        redeal_states(states, 3)
    with pytest.raises(ValueError, match="incomplete or mixed"):
        redeal_states(states[:1], 3)
    with pytest.raises(ValueError, match="version 99"):
        redeal_states([{**s, "version": 99} for s in states], 3)


@pytest.mark.parametrize("old_world,new_world", [(2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_stops_inside_a_round_and_inside_the_last_round_of_the_run(old_world, new_world, sharding):
    """A wide window makes each round plan several steps, so the stop leaves planned steps in the
    queue: in the middle of the run, and in the last round of the last epoch."""
    config = OdbConfig(max_tokens=64, window=48, gas=1, sharding=sharding)
    samples = [(10 + (7 * i) % 50, 0) for i in range(150)]
    total = len(stop_and_redeal(config, samples, old_world, old_world, 10**6, epochs=2)[0][0])
    for k in (1, total // 2, total - 1):
        head, tail = stop_and_redeal(config, samples, old_world, new_world, k, epochs=2)
        assert uids(head) + uids(tail) == Counter(range(2 * len(samples)))
        check_aligned(tail)
        assert tail[0] and tail[0][0].step == k


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (2, 3)])
def test_the_fixed_baseline_resumes_on_another_number_of_ranks(old_world, new_world):
    """Held samples come back unpacked, as many as a window: the fixed packer batches them without
    waiting for more (it used to wait for an add that a full window never makes, for ever)."""
    config = OdbConfig(max_tokens=1024, window=8, lookahead=4, gas=2, policy="fixed", batch_size=2,
                       sharding="static", cost_model="manual")
    samples = [(20 + (i * 53) % 580, 0) for i in range(69)]
    head, tail = stop_and_redeal(config, samples, old_world, new_world, 1, epochs=1)
    assert uids(head) + uids(tail) == Counter(range(len(samples)))
    check_aligned(tail)
