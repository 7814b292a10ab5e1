"""over_cap 'sequence_parallel' under the real batcher: simulated ranks on a long-tail trace, 5% of
its samples 2-8x a rank's budget. The oracle is the trace itself: every sample trains exactly once,
whole where the largest group holds it (and cut to that group's reach, counted, where not); each
long sample is trained at one position by the smallest aligned group of consecutive ranks that
holds it at ``max_tokens`` a rank, every rank of which has it there and nothing else; the ranks stay
aligned, no rank's share of a micro-batch exceeds ``max_tokens``, and each step's label tokens count
a long sample once. A resume from a state taken mid-epoch, with shared micro-batches queued, plans
what the uninterrupted run plans."""

from collections import Counter

import numpy as np
import pytest

from conftest import check_aligned, check_exact_once, check_label_tokens, roundtrip, run_to_state, simulated_labels
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.cost import SampleCost
from odb.batching.decide import decide
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks
from odb.batching.state import decode_steps
from odb.batching.wire import Proposal

MAX_TOKENS = 1024


def trace(n=400, seed=5):
    """Lengths: 95% lognormal within the budget, 5% uniform in 2-8x it."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(5.5, 0.8, n).clip(16, MAX_TOKENS).astype(int)
    long = rng.random(n) < 0.05
    lengths[long] = rng.integers(2 * MAX_TOKENS, 8 * MAX_TOKENS + 1, int(long.sum()))
    return [(int(t), 0) for t in lengths]


def config(**overrides):
    return OdbConfig(**{"max_tokens": MAX_TOKENS, "window": 32, "lookahead": 16, "gas": 2, "cost_model": "manual",
                        "attn_coef": 1e-4, "a2a_coef": 0.2, "over_cap": "sequence_parallel", "seed": 4, **overrides})


def run(world, lengths, cfg=None, epochs=2):
    def rank_main(comm):
        batcher = OnlineBatcher(cfg or config(), comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths),
                                num_epochs=epochs)
        return list(batcher), batcher.stats

    out = run_ranks(world, rank_main)
    return [steps for steps, _ in out], [stats for _, stats in out]


def smallest_group(tokens, world):
    return next(d for d in (2, 4, 8, 16) if tokens <= d * MAX_TOKENS and d <= world)


def check_groups(steps, world):
    """Each shared position: its group (aligned, the smallest that holds the sample) all have it,
    the owner holds the sample, the others nothing of their own; each rank's share fits the budget."""
    trained = {}
    for s in range(len(steps[0])):
        for p in range(len(steps[0][s].micro_batches)):
            micro = [steps[r][s].micro_batches[p] for r in range(world)]
            for r, m in enumerate(micro):
                if m.shared is None:
                    assert m.tokens <= MAX_TOKENS, f"rank {r} step {s} position {p}: {m.tokens} tokens"
                    continue
                owner, degree, tokens = m.shared
                group = range(owner // degree * degree, owner // degree * degree + degree)
                assert r in group and degree == smallest_group(tokens, world)
                assert -(-tokens // degree) <= MAX_TOKENS
                assert all(micro[q].shared == m.shared for q in group), f"step {s} position {p}: group differs"
                if r == owner:
                    assert len(m.samples) == 1 and m.tokens == tokens > MAX_TOKENS
                    trained[m.samples[0].uid] = tokens
                else:
                    assert not m.samples and not m.is_dummy
    return trained


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_long_sample_trains_whole_on_its_group_exactly_once_and_the_ranks_stay_aligned(world):
    lengths = trace()
    steps, stats = run(world, lengths)
    check_aligned(steps)
    size = len(lengths)
    check_exact_once(steps, Counter({e * size + i: 1 for e in range(2) for i in range(size)}))
    long_cap = world * MAX_TOKENS
    labels = simulated_labels([t for t, _ in lengths])
    check_label_tokens(steps, labels, long_cap)  # (a long sample's label tokens: once, at its owner)
    trained = check_groups(steps, world)
    expected = {e * size + i: min(t, long_cap) for e in range(2) for i, (t, _) in enumerate(lengths) if t > MAX_TOKENS}
    assert trained == expected, "a long sample was not trained whole by a group (or not at all)"
    over = sum(1 for t, _ in lengths if t > long_cap) * 2
    assert sum(s.truncated for s in stats) == over and sum(s.long for s in stats) == len(expected) - over
    assert sum(s.truncated_tokens for s in stats) == 2 * sum(t - long_cap for t, _ in lengths if t > long_cap)
    if world == 8:
        assert over == 0, "at 8 ranks every sample of the trace (up to 8x the budget) trains whole"
    shared = sum(1 for s in steps[0] for m in s.micro_batches if m.shared is not None)
    print(f"{world} ranks: {len(steps[0])} steps; {len(expected) - over} long samples whole; {over} cut to "
          f"{world}x the budget; rank 0 took part in {shared} shared micro-batches")


def test_ranks_outside_a_group_fill_its_position_with_their_own_work():
    """At 4 ranks a sample 2x the budget takes ranks 0-1 (or 2-3): the other two train their own
    bins there, not dummies, while they have bins."""
    lengths = [(3 * MAX_TOKENS // 2, 0)] + [(500, 0)] * 63
    steps, _ = run(4, lengths, epochs=1)
    positions = [(s, p) for s in range(len(steps[0])) for p, m in enumerate(steps[0][s].micro_batches)
                 if m.shared is not None] + [(s, p) for s in range(len(steps[2])) for p, m in
                                             enumerate(steps[2][s].micro_batches) if m.shared is not None]
    assert len(positions) == 1
    s, p = positions[0]
    micro = [steps[r][s].micro_batches[p] for r in range(4)]
    group = [r for r, m in enumerate(micro) if m.shared is not None]
    assert group in ([0, 1], [2, 3])
    others = [m for r, m in enumerate(micro) if r not in group]
    assert all(m.samples and m.shared is None for m in others), "the ranks outside the group ran dummies"


def test_a_resume_with_shared_micro_batches_queued_plans_as_the_uninterrupted_run():
    lengths = trace(200, seed=8)

    def make(comm):
        return OnlineBatcher(config(gas=4), comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))

    whole, _ = run_to_state(make, 4, stop_after=10 ** 6)
    queued = 0  # resumes with a shared micro-batch queued (planned, not trained)
    for k in range(1, 13):
        head, states = run_to_state(make, 4, stop_after=k)
        queued += any(m.shared is not None for state in states for s in decode_steps(state["queue"])
                      for m in s.micro_batches)

        def resumed(comm, states=states):
            batcher = make(comm)
            batcher.load_state_dict(roundtrip(states[comm.rank]))
            return list(batcher)

        tail = run_ranks(4, resumed)
        assert [a + b for a, b in zip(head, tail, strict=True)] == whole, f"a resume after {k} steps plans otherwise"
    assert queued, "no resume had a shared micro-batch queued"


def stopped_on_four_dealt_to_two(stop_after):
    """The trace on 4 ranks stopped after ``stop_after`` steps, its states dealt to 2 ranks:
    ``(lengths, make, head steps, dealt states)``."""
    lengths = trace(200, seed=8)

    def make(comm):
        return OnlineBatcher(config(gas=2), comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))

    head, states = run_to_state(make, 4, stop_after=stop_after)
    return lengths, make, head, redeal_states(states, 2)


def test_a_resume_on_fewer_ranks_cuts_what_the_smaller_groups_cannot_hold_and_trains_the_rest_once():
    lengths, make, head, dealt = stopped_on_four_dealt_to_two(5)

    def resumed(comm):
        batcher = make(comm)
        batcher.load_state_dict(roundtrip(dealt[comm.rank]))
        return list(batcher)

    tail = run_ranks(2, resumed)
    check_aligned(tail)
    trained = Counter(u for rank in head + tail for s in rank for m in s.micro_batches for u in m.uids)
    assert trained == Counter(range(len(lengths)))
    check_groups(tail, 2)  # (every long sample of the tail: within 2x the budget, on a group of 2)


def test_held_samples_processed_again_otherwise_are_planned_as_processed_or_left_out_counted():
    """A resume on fewer ranks processes the samples it holds again, cut at the smaller groups'
    reach by turns (shorter than that reach, or to no label: skipped). remeasure plans them as the
    data now is: each trains once with its new size, and a skipped one is counted, not planned."""
    lengths, make, head, dealt = stopped_on_four_dealt_to_two(2)
    held = [SampleCost(*row) for state in dealt for row in state["unpacked"]]
    over = [s for s in held if s.tokens > 2 * MAX_TOKENS]
    assert len(over) >= 2, "the stop left fewer than 2 samples over 2x the budget in the windows"
    shorter, skipped = over[0], over[1]
    sizes = {shorter.uid: (2 * MAX_TOKENS - 10, 2 * MAX_TOKENS - 11, 0), skipped.uid: None}

    def resumed(comm):
        batcher = make(comm)
        batcher.load_state_dict(roundtrip(dealt[comm.rank]))
        batcher.remeasure(sizes)
        return list(batcher), batcher.stats

    out = run_ranks(2, resumed)
    tail = [steps for steps, _ in out]
    check_aligned(tail)
    trained = Counter(u for rank in head + tail for s in rank for m in s.micro_batches for u in m.uids)
    assert trained == Counter(set(range(len(lengths))) - {skipped.uid})
    tokens = {s.uid: s.tokens for rank in tail for step in rank for m in step.micro_batches for s in m.samples}
    assert tokens[shorter.uid] == 2 * MAX_TOKENS - 10
    assert sum(stats.skipped for _, stats in out) == 1


@pytest.mark.parametrize("gas", [1, 2, 3, 4])
def test_the_last_round_holds_every_long_sample_whatever_the_gas(gas):
    """The drain round grows T to hold every long bin and rounds it up to GAS (a review found an
    IndexError at GAS 3 and 4 on 2 ranks)."""
    lengths = [(3 * MAX_TOKENS // 2, 0), (3 * MAX_TOKENS // 2, 0), (300, 0)]
    steps, _ = run(2, lengths, cfg=config(gas=gas, window=4, lookahead=0), epochs=1)
    check_aligned(steps)
    check_exact_once(steps, Counter(range(3)))
    assert check_groups(steps, 2).keys() == {0, 1}
    assert all(len(s.micro_batches) == gas for s in steps[0])


def test_a_rank_whose_long_sample_must_wait_trains_its_other_bins_meanwhile():
    """One position (T = 1), 4 ranks: ranks 0-1 take it for rank 0's sample of 1.5x the budget, so
    rank 2's sample of 3x (all four ranks) waits for the next round; rank 2 trains an ordinary bin
    of its own there instead of a dummy (the decision alone, from the ranks' proposals)."""
    def proposal(tokens):
        return Proposal(is_fatal=False, is_exhausted=False, num_ready=len(tokens), window_samples=len(tokens),
                        window_cost=sum(tokens), num_pending=0, observed_cost=sum(tokens), observed_cost_sq=0,
                        observed_samples=1, is_first_pass_open=False, num_skipped=0, num_dropped=0,
                        bin_costs=tokens, bin_samples=[1] * len(tokens), bin_tokens=tokens,
                        bin_labels=[t - 1 for t in tokens])

    ranks = [proposal([150, 90]), proposal([90]), proposal([300, 90, 90]), proposal([90, 90])]
    layout = ranks[0].layout(4, 4)
    fields = layout.decode(np.stack([layout.encode(**p.values()) for p in ranks]))
    decision = decide(fields, gas=1, seed=0, epoch=0, round_index=0, quota_left=None, stream_left=0,
                      inflight_target=8, max_tokens=100, degrees=(2, 4))
    assert decision.shared.tolist() == [[0], [0], [-1], [-1]] and decision.slots[:2].tolist() == [[0], [-1]]
    assert decision.slots[2].tolist() == [1] and decision.slots[3].tolist() == [0], "a free rank ran a dummy"
    assert decision.step_label_tokens == [149 + 89 + 89]  # (the long one once, at its owner)
