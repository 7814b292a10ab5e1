"""Randomized fuzzer, resume: random settings and records (as tests/sim/test_fuzz_join.py's) run
once, every rank's state kept after every step; then a resume from the state at EVERY round
boundary (and a few steps inside rounds) on the same ranks must plan exactly the rest of that run
(I6), and a chain of re-deals onto other numbers of ranks (W -> W1 -> W2, each stop at a random
step) must train every admitted record exactly once per epoch over all parts, aligned, with the
skipped and dropped records counted once. The oracles are the records (tests/fuzzing.py). Quota
mode: exactly ``quota`` samples, each once, across resumes and re-deals. The cost fit: the
coefficients agree on every rank and a re-deal chain keeps exact-once (its plans follow the
measured times, so a resume is not compared step by step)."""

from collections import Counter

import numpy as np
import pytest

from conftest import check_aligned
from fuzzing import (
    batcher_of,
    check_samples,
    expected_uids,
    long_cap,
    plans,
    random_config,
    random_lengths,
    redeal_chain,
    round_boundaries,
    run_states,
    trained,
)
from odb.batching.config import OdbConfig
from odb.batching.plan import NoSampleAdmitted
from odb.batching.redeal import redeal_states


def instance(seed: int, **overrides):
    rng = np.random.default_rng(seed)
    config = random_config(rng, **overrides)
    lengths = random_lengths(rng, config.max_tokens, 60)
    return config, lengths, int(rng.choice([1, 2, 3, 4, 5, 6])), int(rng.integers(1, 3)), rng


def check_resumes(make, full, states, rng, most=None):
    """A resume at every round boundary (``most``: that many of them, at random), and at 3 steps
    inside rounds, plans what ``full`` did."""
    boundaries = round_boundaries(states)
    if most is not None and len(boundaries) > most:
        boundaries = rng.choice(boundaries, most, replace=False).tolist()
    inside = [k for k in range(len(full[0]) + 1) if k not in boundaries]
    for k in sorted(boundaries + rng.choice(inside, min(3, len(inside)), replace=False).tolist()):
        tail, _, _ = run_states(make, len(full), [rank_states[k] for rank_states in states])
        assert plans(tail) == plans([rank_steps[k:] for rank_steps in full]), f"a resume after step {k} differs"


def check_join(seed):
    config, lengths, world, epochs, rng = instance(seed)
    make = batcher_of(config, lengths, epochs)
    full, states, _ = run_states(make, world)
    uids, dropped, skipped = expected_uids(config, lengths, epochs, world)
    assert trained(full) == uids
    check_resumes(make, full, states, rng)
    worlds = [int(w) for w in rng.integers(1, 7, 2)]
    steps, batchers = redeal_chain(make, full, states, worlds, rng)
    got = trained(steps)
    assert got == uids, (f"over {world} -> {worlds} ranks: missing {sorted((uids - got).elements())[:10]}, "
                         f"extra {sorted((got - uids).elements())[:10]}")
    if config.over_cap != "sequence_parallel":  # (a re-deal onto fewer ranks cuts some long ones again)
        counts = Counter()
        for batcher in batchers:
            counts.update({k: batcher.counts[k] for k in ("skipped", "dropped")})
        assert counts == Counter(skipped=skipped, dropped=dropped), (counts, skipped, dropped)


@pytest.mark.parametrize("chunk", range(4))
def test_resume_at_every_round_boundary_and_redeal_chains_keep_exact_once(chunk):
    for seed in range(chunk * 60, (chunk + 1) * 60):
        try:
            check_join(seed)
        except Exception as err:
            raise AssertionError(f"seed {seed}: {instance(seed)[:4]}") from err


def check_quota(seed):
    rng = np.random.default_rng(20_000 + seed)
    config = random_config(rng, mode="quota", quota=int(rng.integers(1, 400)), policy=str(rng.choice(["odb", "fixed"])))
    lengths = random_lengths(rng, config.max_tokens, 80) or [(5, 0)]
    world = int(rng.choice([1, 2, 3, 4, 6]))
    if config.sharding == "static" and len(lengths) < world:  # (an empty static shard: only its last step)
        config = OdbConfig(**{**config.to_dict(), "sharding": "dynamic"})
    admitted = {i for i, e in enumerate(lengths) if e is not None and not (
        (config.max_patches is not None and e[1] > config.max_patches)
        or (config.over_cap == "drop" and e[0] > config.max_tokens))}
    make = batcher_of(config, lengths)
    try:
        full, states, _ = run_states(make, world)
    except NoSampleAdmitted:
        assert not admitted, "quota mode gave up with records it could train"
        return
    for steps in [full] + ([] if config.sharding == "static" else [
            redeal_chain(make, full, states, [int(w) for w in rng.integers(1, 7, 2)], rng)[0]]):
        got = trained(steps)
        assert sum(got.values()) == config.quota and max(got.values()) == 1, (sum(got.values()), config.quota)
        assert {u % len(lengths) for u in got} <= admitted
    check_aligned(full)
    check_samples(full, lengths, config.max_tokens)
    check_resumes(make, full, states, rng, most=6)  # (a quota run has many rounds: each resume runs the rest)


@pytest.mark.parametrize("chunk", range(3))
def test_quota_mode_trains_exactly_the_quota_across_resumes_and_redeals(chunk):
    for seed in range(chunk * 30, (chunk + 1) * 30):
        try:
            check_quota(seed)
        except Exception as err:
            raise AssertionError(f"seed {seed}") from err


def seconds(step):
    """A micro-batch's forward time: a fixed part, the tokens, the attention area, the patches and
    (a rank's slice of a long sample) the all-to-all."""
    out = []
    for m in step.micro_batches:
        if m.shared is not None:
            tokens = m.shared.tokens / m.shared.degree
            out.append(1e-4 * (5 + 1.5 * tokens + 2e-3 * m.shared.tokens ** 2 / m.shared.degree))
        else:
            out.append(1e-4 * (5 + sum(s.tokens + 2e-3 * s.tokens ** 2 + 0.3 * s.patches for s in m.samples)))
    return out


@pytest.mark.parametrize("chunk", range(2))
def test_the_cost_fit_agrees_on_every_rank_and_keeps_exact_once_across_redeals(chunk):
    for seed in range(chunk * 100, (chunk + 1) * 100):
        config, lengths, world, epochs, rng = instance(40_000 + seed, cost_model="fit",
                                                       policy=str(np.random.default_rng(seed).choice(["odb", "fixed"])))
        lengths = lengths + random_lengths(rng, config.max_tokens, 90)  # (enough micro-batches to fit)
        make = batcher_of(config, lengths, epochs)
        full, states, batchers = run_states(make, world, observe=seconds)
        assert len({repr(b.cost_fit) for b in batchers}) == 1, f"seed {seed}: the ranks' fits differ"
        uids = expected_uids(config, lengths, epochs, world)[0]
        assert trained(full) == uids, f"seed {seed}"
        check_samples(full, lengths, long_cap(config, world))
        steps, batchers = redeal_chain(make, full, states, [int(w) for w in rng.integers(1, 7, 2)], rng,
                                       observe=seconds)
        assert trained(steps) == uids, f"seed {seed}: a re-deal chain lost or doubled a sample"
        assert len({repr(b.cost_fit) for b in batchers}) == 1, f"seed {seed}: the ranks' fits differ after it"


@pytest.mark.parametrize("policy", ["gmt", "bmt"])
def test_an_offline_baseline_redealt_onto_one_rank_between_epochs_trains_the_rest(policy):
    """gmt / bmt plan a whole epoch in one round; a checkpoint after its first step holds the
    epoch's other steps (queued) and the next epoch's shard (pending). Re-dealt onto one rank, that
    rank holds both, more than one epoch's records: its round vector must hold them all (it had
    room for one epoch's, and the round stopped the run: "wire field 'sample_labels' holds 20
    values, got 28")."""
    config = OdbConfig(max_tokens=64, window=4, sharding="static", policy=policy, bucket_size=8,
                       cost_model="manual")
    lengths = [(10, 0)] * 20
    make = batcher_of(config, lengths, epochs=2)
    full, states, _ = run_states(make, 2)
    tail, _, _ = run_states(make, 1, redeal_states([rank_states[1] for rank_states in states], 1))
    assert trained([rank_steps[:1] for rank_steps in full]) + trained(tail) == Counter(range(40))


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_a_resume_with_fewer_epochs_than_the_checkpoint_began_is_refused_naming_epochs(sharding):
    """A 3-epoch run checkpointed in its third epoch, resumed with num_epochs 1 (--epochs 1), went
    on to train the rest of the third epoch: 16 samples of an epoch the resumed run never asked for,
    without a word. It is refused, naming --epochs; with 3 or more epochs it resumes, and a finished
    run's state loads with fewer (nothing is left to train)."""
    config = OdbConfig(max_tokens=64, window=4, sharding=sharding, cost_model="manual")
    lengths = [(30, 0)] * 12
    full, states, _ = run_states(batcher_of(config, lengths, 3), 2)
    stop = next(k for k, s in enumerate(states[0]) if s["epoch"] == 2 and not s["is_planned"])
    for epochs in (1, 2):
        with pytest.raises(ValueError, match=r"epoch 3 .* --epochs 3 or more"):
            run_states(batcher_of(config, lengths, epochs), 2, [s[stop] for s in states])
    tail, _, _ = run_states(batcher_of(config, lengths, 3), 2, [s[stop] for s in states])
    assert trained([rank_steps[:stop] for rank_steps in full]) + trained(tail) == Counter(range(36))
    done, _, _ = run_states(batcher_of(config, lengths, 1), 2, [s[-1] for s in states])
    assert done == [[], []]
