"""A state taken inside the last round of a run (its steps planned, some still queued) resumes on
the same number of ranks and trains exactly the queued steps: the oracle is the uninterrupted run.
Only the state taken after the last step is finished (the checkpoint code refuses to resume that
one without more epochs)."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import roundtrip
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import SimulatedFeed, run_ranks
from odb.batching.state import is_finished, upgrade_state


def run_with_snapshots(config, samples, world, epochs):
    """The uninterrupted run: every rank's steps, and its state after each step (as JSON would
    carry it) with whether the batcher said it was done right then."""

    def rank_main(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples),
                                num_epochs=epochs)
        steps, states = [], []
        for step in batcher:
            steps.append(step)
            states.append((roundtrip(batcher.state_dict()), batcher.is_done, len(batcher.queue)))
        return steps, states

    out = run_ranks(world, rank_main)
    return [steps for steps, _ in out], [states for _, states in out]


def resume(config, samples, world, epochs, states):
    """Every rank's remaining steps, from ``states[rank]`` loaded into a fresh batcher."""

    def rank_main(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples),
                                num_epochs=epochs)
        batcher.load_state_dict(states[comm.rank])
        return list(batcher)

    return run_ranks(world, rank_main)


def check_last_round(config, samples, world, epochs):
    full, states = run_with_snapshots(config, samples, world, epochs)
    total = len(full[0])
    assert total and all(len(steps) == total for steps in full)
    # the steps after which the batcher had planned everything: the last round's
    last_round = [k for k in range(total) if states[0][k][0]["is_planned"]]
    assert last_round and last_round[-1] == total - 1
    for k in range(total):
        for rank in range(world):
            state, was_done, queued = states[rank][k]
            assert was_done == (k == total - 1), f"step {k}: the batcher said done with {queued} step(s) queued"
            assert is_finished(state) == (k == total - 1)
    for k in last_round:
        rest = resume(config, samples, world, epochs, [states[r][k][0] for r in range(world)])
        assert rest == [steps[k + 1:] for steps in full], f"resumed after step {k} of {total}"
    return full, states, last_round


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
@pytest.mark.parametrize("gas,epochs", [(1, 1), (2, 1), (1, 2)])
def test_every_step_of_the_last_round_resumes_the_queued_steps_on_the_same_world_size(sharding, gas, epochs):
    """The issue's case: 2 ranks, 60 samples, a small window (the last round plans several steps)."""
    config = OdbConfig(max_tokens=96, window=16, gas=gas, sharding=sharding)
    samples = [(10 + (7 * i) % 50, 0) for i in range(60)]
    _, _, last_round = check_last_round(config, samples, 2, epochs)
    assert len(last_round) >= 2, "the case needs a last round of several steps"


def test_quota_mode_resumes_the_last_round_too():
    config = OdbConfig(max_tokens=96, window=16, mode="quota", quota=75)
    samples = [(10 + (7 * i) % 50, 0) for i in range(60)]
    full, _, last_round = check_last_round(config, samples, 3, 1)
    assert sum(len(m.samples) for steps in full for s in steps for m in s.micro_batches) == 75
    assert len(last_round) >= 2


def test_a_version_1_state_of_the_last_round_still_resumes_its_queued_steps():
    """Checkpoints written before the fix called the flag ``is_done`` (version 1): read as planned,
    not finished, while their queue holds steps."""
    config = OdbConfig(max_tokens=128, window=8)
    samples = [(10 + (7 * i) % 50, 0) for i in range(60)]
    full, states = run_with_snapshots(config, samples, 2, 1)
    k = next(k for k in range(len(full[0])) if states[0][k][0]["is_planned"])
    old = []
    for rank in range(2):
        state = copy.deepcopy(states[rank][k][0])
        state["version"], state["is_done"] = 1, state.pop("is_planned")
        old.append(state)
    before = copy.deepcopy(old)
    assert not is_finished(old[0]) and upgrade_state(old[0])["is_planned"]
    assert resume(config, samples, 2, 1, old) == [steps[k + 1:] for steps in full]
    assert old == before, "loading never mutates the state"


def test_the_state_after_the_last_step_is_finished_and_resumes_to_nothing():
    config = OdbConfig(max_tokens=128, window=8)
    samples = [(10 + (7 * i) % 50, 0) for i in range(60)]
    full, states = run_with_snapshots(config, samples, 2, 1)
    final = [states[r][-1][0] for r in range(2)]
    assert all(is_finished(s) for s in final)
    assert resume(config, samples, 2, 1, final) == [[], []]
    # with one more epoch it goes on: the next epoch, as a two-epoch run's second
    more = resume(config, samples, 2, 2, final)
    assert more[0] and {s.epoch for s in more[0]} == {1}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 120), min_size=1, max_size=120), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 24), st.booleans(), st.integers(1, 2))
def test_any_last_round_resumes_exactly(lengths, world, gas, window, static, epochs):
    config = OdbConfig(max_tokens=128, window=max(window, gas), gas=gas, sharding="static" if static else "dynamic")
    check_last_round(config, [(t, 0) for t in lengths], world, epochs)
