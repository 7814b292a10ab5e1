"""Every small instance, not a sample of them: the guarantees checked as a finite proof.

Instances: up to 6 samples of lengths {1, 3} (cap 4: 1+3 fills a bin, 3+3 does not fit, 1+1
waits for more), dealt to 2-3 ranks in every possible way (static shards) or through the
shared stream (dynamic), windows 1-3, GAS 1-2. For each: aligned (I1), every sample exactly
once (I2), N_step exact (I4), caps (I5), and termination within the stated round bound (I3).
"""

import itertools
from collections import Counter

import pytest

from conftest import check_aligned, check_caps, check_exact_once, check_label_tokens, simulated_labels
from odb.batching.config import OdbConfig
from odb.batching.simulate import simulate

LENGTHS = (1, 3)
CONFIGS = [(window, gas) for window in (1, 2, 3) for gas in (1, 2) if window >= gas]


def instances(world: int, max_samples: int):
    for n in range(max_samples + 1):
        for lengths in itertools.product(LENGTHS, repeat=n):
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


@pytest.mark.parametrize("world,max_samples", [(2, 6), (3, 4)])
@pytest.mark.parametrize("window,gas", CONFIGS)
def test_every_static_instance(world, max_samples, window, gas):
    config = OdbConfig(max_tokens=4, window=window, gas=gas, sharding="static", lookahead=0)
    count = 0
    for lengths, shards in instances(world, max_samples):
        if world == 2 and len(lengths) == 6 and (window, gas) not in ((1, 1), (3, 2)):
            continue  # the 4096 six-sample instances once per GAS, at the extreme windows
        check(config, lengths, world, shards)
        count += 1
    assert count > 1000


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("window,gas", CONFIGS)
@pytest.mark.parametrize("lookahead", [0, 2])
def test_every_dynamic_instance(world, window, gas, lookahead):
    config = OdbConfig(max_tokens=4, window=window, gas=gas, lookahead=lookahead)
    for n in range(7):
        for lengths in itertools.product(LENGTHS, repeat=n):
            check(config, lengths, world)
