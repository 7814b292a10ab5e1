"""The budget search of max_tokens auto against a brute force over synthetic memory curves."""

from __future__ import annotations

import math
import random

import pytest

from odb.training.run.budget import QUANTUM, search_budget


def brute_force(measure, cap, upper):
    fitting = [b for b in range(QUANTUM, upper + 1, QUANTUM) if measure(b) <= cap]
    return max(fitting) if fitting else None


def curves(seed):
    rng = random.Random(seed)
    static, per_token = rng.uniform(100, 60_000), rng.uniform(0.01, 3.0)
    square = rng.uniform(1e-6, 1e-3)
    yield "linear", lambda b: static + per_token * b
    yield "quadratic", lambda b: static + per_token * b + square * b * b  # attention that is not varlen-flash
    yield "steps", lambda b: static + 512 * math.ceil(per_token * b / 512)  # an allocator's block sizes
    yield "noisy", lambda b: static + per_token * b + (b * 7919 % 13)  # monotone with a little jitter


@pytest.mark.parametrize("seed", range(40))
def test_the_search_finds_the_largest_budget_that_fits_as_a_brute_force_does(seed):
    rng = random.Random(seed)
    for name, measure in curves(seed):
        upper = rng.choice([4096, 32768, 131072, 1000])
        cap = measure(rng.randrange(QUANTUM, 2 * upper))  # the answer anywhere, upper included, or none
        if rng.random() < 0.1:
            cap = measure(QUANTUM) - 1  # nothing fits
        best, trials = search_budget(measure, cap, upper=upper, max_trials=24)
        expected = brute_force(measure, cap, (upper // QUANTUM) * QUANTUM)
        assert best == expected, (name, seed, upper, cap, trials)
        assert len(trials) <= 24
        measured = {t.budget: t for t in trials}
        assert all(t.budget % QUANTUM == 0 and QUANTUM <= t.budget <= max(QUANTUM, upper) for t in trials)
        if best is not None:  # the answer was measured to fit, and the next budget up not to (or is past upper)
            assert measured[best].fits
            assert best + QUANTUM > upper or not measured[best + QUANTUM].fits
        else:
            assert not measured[QUANTUM].fits


def test_a_roughly_linear_curve_takes_a_handful_of_trials():
    """Memory that grows linearly with tokens (varlen attention, chunked loss) takes the doublings
    up to the cap and two more trials, not a halving down to one quantum as well."""
    counts = []
    for seed in range(20):
        rng = random.Random(seed)
        static, per_token = rng.uniform(1_000, 60_000), rng.uniform(0.05, 2.0)
        cap = static + per_token * rng.randrange(2_000, 120_000)
        _, trials = search_budget(lambda b: static + per_token * b, cap, upper=131072)
        counts.append(len(trials))
    print(f"trials for a linear curve: {sorted(counts)}")
    assert max(counts) <= 9  # 1024 -> 131072: 7 doublings at most, then 2


def test_doubling_never_jumps_past_the_line_through_the_last_two_trials():
    """On the way up, a trial is never far over the cap where the last two trials predicted
    otherwise: the step at most doubles and stops at the predicted crossing."""
    measure = lambda b: 1_000 + 0.5 * b  # noqa: E731
    cap = measure(10_000)
    _, trials = search_budget(measure, cap, upper=131072)
    over = [t for t in trials if not t.fits]
    assert over and all(t.budget <= 10_000 + 2 * QUANTUM for t in over), trials


def test_the_search_stops_after_max_trials_with_the_largest_budget_that_fit():
    calls = []

    def measure(b):
        calls.append(b)
        return b  # the cap sits far above the start: doubling takes many trials

    best, trials = search_budget(measure, 100_000, upper=10**6, start=64, max_trials=3)
    assert len(trials) == len(calls) == 3
    assert best == max(t.budget for t in trials if t.fits)
