"""Every small instance, not a sample of them: the guarantees checked as a finite proof (shared by
tests/sim/test_exhaustive.py, the smallest instances, in the loop while coding, and
tests/proof/test_exhaustive_large.py, the rest, in the full suite).

Instances: up to 6 samples of lengths {1, 3} (cap 4: 1+3 fills a bin, 3+3 does not fit, 1+1
waits for more), dealt to 2-3 ranks in every possible way (static shards) or through the
shared stream (dynamic), windows 1-3, GAS 1-2. For each: aligned (I1), every sample exactly
once (I2), N_step exact (I4), caps (I5), and termination within the stated round bound (I3).
"""

from __future__ import annotations

import itertools
from collections import Counter

from conftest import check_aligned, check_caps, check_exact_once, check_label_tokens, simulated_labels
from odb.batching.config import OdbConfig
from odb.batching.simulate import simulate

LENGTHS = (1, 3)
CONFIGS = [(window, gas) for window in (1, 2, 3) for gas in (1, 2) if window >= gas]


def lengths_of(sizes: range):
    """Every tuple of sample lengths with a number of samples in ``sizes``."""
    for n in sizes:
        yield from itertools.product(LENGTHS, repeat=n)


def static_instances(world: int, sizes: range):
    """Every (lengths, shards): each sample count in ``sizes``, each owner of each sample."""
    for lengths in lengths_of(sizes):
        n = len(lengths)
        for owners in itertools.product(range(world), repeat=n):
            yield lengths, [[i for i in range(n) if owners[i] == r] for r in range(world)]


def check(config: OdbConfig, lengths, world, shards=None) -> None:
    result = simulate(config, [(t, 0) for t in lengths], world, shards=shards, timeout_s=20)
    check_aligned(result.steps)
    check_exact_once(result.steps, Counter(range(len(lengths))))
    check_label_tokens(result.steps, simulated_labels(lengths), config.max_tokens)
    check_caps(result.steps, config.max_tokens)
    rounds = result.batchers[0].round_index
    bound = max(len(s) for s in shards) + 1 if shards is not None else 2 * len(lengths) + 2
    assert rounds <= bound, (lengths, shards, rounds)


def check_static(world: int, sizes: range, window: int, gas: int) -> int:
    """Checks every static instance; returns how many."""
    config = OdbConfig(max_tokens=4, window=window, gas=gas, sharding="static", lookahead=0)
    count = 0
    for lengths, shards in static_instances(world, sizes):
        check(config, lengths, world, shards)
        count += 1
    return count


def check_dynamic(world: int, sizes: range, window: int, gas: int, lookahead: int) -> int:
    """Checks every dynamic instance; returns how many."""
    config = OdbConfig(max_tokens=4, window=window, gas=gas, lookahead=lookahead)
    count = 0
    for lengths in lengths_of(sizes):
        check(config, lengths, world)
        count += 1
    return count
