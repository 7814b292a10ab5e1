"""Stragglers and jitter over simulated ranks: random delays in data loading and in each step.

What the jitter exercises. :meth:`SimulatedGroup.run` runs one rank at a time (a baton handed
over inside collectives), so a ``time.sleep`` in a rank's fetch or step would hold the baton and
barely change the interleaving. These tests therefore start the rank threads themselves, with
communicators from :meth:`SimulatedGroup.communicator` that never take the baton: the ranks run
truly concurrently, sleeping (GIL released) in their feeds and between steps. A straggler (one
or two ranks 5-10x slower) makes the fast ranks arrive first at every collective and wait in it
while the straggler is still fetching or training, and on the way out of a collective the fast
ranks race into the next one while slower ranks still read the last one's result (the group's
double buffer). :func:`run_free` records every sleep, and each test asserts that sleeps of
different ranks overlapped in time, i.e. that the run really was concurrent.

The oracle. Every decision of the batcher is a pure function of the gathered data (I3, I6), and
a feed's fetch blocks until the samples are there, so timing must not change anything: the plan
of every rank, with jitter, equals the plan of the same config and data without jitter, run
one rank at a time by :func:`odb.batching.simulate.simulate`. On top of that oracle the
invariants are checked directly: I1 (same steps and micro-batches per step on every rank), I2
(every sample exactly once per epoch in join mode; the quota exactly in quota mode) and I4 (each
step's label-token and sample counts).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import check_aligned, check_caps, check_exact_once, check_label_tokens, simulated_labels
from odb.batching.align import SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.plan import StepPlan
from odb.batching.simulate import SimulatedFeed, simulate

NUM_SEEDS = 50
FETCH_DELAY_S = 0.005  # a fetch sleeps uniform(0, 5 ms) x the rank's slowness
STEP_DELAY_S = 0.001  # a step sleeps uniform(0, 1 ms) x the rank's slowness


@dataclass
class Jitter:
    """One rank's delays: seeded, ``slowness`` x uniform(0, base) seconds, every sleep recorded."""

    rng: random.Random
    slowness: float
    sleeps: list[tuple[float, float]] = field(default_factory=list)  # (start, end), perf_counter

    def sleep(self, base_s: float) -> None:
        start = time.perf_counter()
        time.sleep(self.rng.uniform(0.0, base_s) * self.slowness)
        self.sleeps.append((start, time.perf_counter()))


class JitteryFeed:
    """A :class:`~odb.batching.batcher.Feed` that sleeps a random delay before each fetch (data
    loading that is sometimes slow), then hands over to the wrapped feed."""

    def __init__(self, inner: SimulatedFeed, jitter: Jitter) -> None:
        self.inner, self.jitter = inner, jitter

    def deal(self, uids: list[int]) -> None:
        self.inner.deal(uids)

    def fetch(self, uids: list[int]) -> list[tuple[int, int, int] | None]:
        self.jitter.sleep(FETCH_DELAY_S)
        return self.inner.fetch(uids)

    def forget(self, uids: list[int]) -> None:
        self.inner.forget(uids)


def run_free(world: int, fn: Callable[[Any], Any], timeout_s: float = 60.0) -> list[Any]:
    """Runs ``fn(comm)`` on ``world`` truly concurrent threads over one :class:`SimulatedGroup`
    (its communicators, without :meth:`SimulatedGroup.run`'s baton); re-raises a failure and
    turns a hang into ``TimeoutError``."""
    group = SimulatedGroup(world, timeout_s=timeout_s)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(group.communicator(rank))
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            errors.append(err)
            group.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        group.abort()
        raise TimeoutError(f"jittered ranks did not finish within {timeout_s} s (a hang)")
    if errors:
        raise errors[0]
    return results


@dataclass
class Scenario:
    config: OdbConfig
    lengths: list[tuple[int, int] | None]
    world: int
    epochs: int
    slowness: list[float]  # per rank; 1 = normal, 5-10 = a straggler


def draw_scenario(seed: int) -> Scenario:
    """A config and data from ``seed``: world 2-8, both sharding policies, join or quota mode,
    GAS 1-4, 1-2 epochs, some records skipped, one or two stragglers."""
    rng = random.Random(seed)
    world = rng.randint(2, 8)
    sharding = ("static", "dynamic")[seed % 2]
    mode = "quota" if seed % 5 == 4 else "join"
    gas = rng.randint(1, 4)
    max_tokens = rng.choice([128, 256, 512])
    edge_sizes = [0, 1, world - 1, rng.randint(world, 30)]  # empty, single, fewer than ranks, small
    num_samples = rng.choice(edge_sizes) if seed % 7 == 6 else rng.randint(60, 300)
    if mode == "quota":
        num_samples = max(num_samples, world)  # a static shard must not be empty in quota mode
    skip_rate = rng.choice([0.0, 0.0, 0.05])
    lengths = [None if rng.random() < skip_rate else (rng.randint(1, max_tokens + 40), 0)
               for _ in range(num_samples)]  # + 40: some samples over the cap, truncated
    quota = rng.randint(1, 2 * num_samples) if mode == "quota" else None
    if mode == "quota" and all(x is None for x in lengths):
        lengths[0] = (5, 0)  # quota mode needs something to train
    config = OdbConfig(max_tokens=max_tokens, gas=gas, window=max(gas, rng.randint(1, 24)),
                       lookahead=rng.randint(0, 16), sharding=sharding, mode=mode, quota=quota, seed=seed)
    stragglers = rng.sample(range(world), rng.randint(1, 2))
    slowness = [rng.uniform(5.0, 10.0) if r in stragglers else 1.0 for r in range(world)]
    return Scenario(config, lengths, world, 1 if mode == "quota" else rng.randint(1, 2), slowness)


def run_jittered(s: Scenario, seed: int) -> tuple[list[list[StepPlan]], list[OnlineBatcher], list[Jitter]]:
    """Every rank's plan with random delays in fetch and after each step, ranks concurrent."""
    jitters = [Jitter(random.Random(f"{seed}/{r}"), s.slowness[r]) for r in range(s.world)]
    batchers: list[OnlineBatcher | None] = [None] * s.world

    def rank_main(comm) -> list[StepPlan]:
        jitter = jitters[comm.rank]
        feed = JitteryFeed(SimulatedFeed(s.lengths), jitter)
        batcher = OnlineBatcher(s.config, comm, dataset_size=len(s.lengths), feed=feed, num_epochs=s.epochs)
        batchers[comm.rank] = batcher
        steps = []
        for step in batcher:
            steps.append(step)
            jitter.sleep(STEP_DELAY_S)  # the step's forward and backward
        return steps

    return run_free(s.world, rank_main), batchers, jitters


def overlapped(jitters: list[Jitter]) -> bool:
    """Whether a sleep of one rank overlapped a sleep of another (the ranks ran concurrently)."""
    spans = sorted((a, b, r) for r, j in enumerate(jitters) for a, b in j.sleeps if b > a)
    latest_end, latest_rank = float("-inf"), -1
    for start, end, rank in spans:
        if start < latest_end and rank != latest_rank:
            return True
        if end > latest_end:
            latest_end, latest_rank = end, rank
    return False


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_jitter_and_stragglers_change_nothing(seed):
    s = draw_scenario(seed)
    steps, batchers, jitters = run_jittered(s, seed)
    # the oracle: the same config and data without jitter, one rank at a time
    calm = simulate(s.config, s.lengths, s.world, num_epochs=s.epochs, timeout_s=60)
    assert steps == calm.steps, "the plan depends on timing"
    assert [b.round_index for b in batchers] == [b.round_index for b in calm.batchers]
    assert [b.counts for b in batchers] == [b.counts for b in calm.batchers]
    # the invariants, directly
    check_aligned(steps)
    check_label_tokens(steps, simulated_labels(s.lengths), s.config.max_tokens)
    check_caps(steps, s.config.max_tokens)
    assert all(len(step.micro_batches) == s.config.gas for rank_steps in steps for step in rank_steps)
    assert all(b.aligner.comm.num_collectives == b.round_index + 1 for b in batchers)
    trained = [u for rank_steps in steps for step in rank_steps for m in step.micro_batches for u in m.uids]
    if s.config.mode == "join":
        kept = [i for i, x in enumerate(s.lengths) if x is not None]
        check_exact_once(steps, Counter(e * len(s.lengths) + i for e in range(s.epochs) for i in kept))
    else:
        assert len(trained) == len(set(trained)) == s.config.quota
    # the jitter did what it is for: ranks ran at once, and there was something to interleave
    if sum(len(j.sleeps) >= 3 for j in jitters) >= 2:
        assert overlapped(jitters), "the ranks never slept at the same time: no concurrency exercised"


def test_a_straggler_makes_the_others_wait_in_collectives():
    """A sanity check of the harness: with one rank 10x slower in every fetch and step, the fast
    ranks spend their time waiting in the round's collective, the straggler hardly at all."""
    config = OdbConfig(max_tokens=256, window=16, gas=2, lookahead=8)
    lengths = [((7 * i) % 250 + 1, 0) for i in range(150)]
    s = Scenario(config, lengths, world=4, epochs=1, slowness=[1.0, 1.0, 10.0, 1.0])
    steps, batchers, _ = run_jittered(s, seed=0)
    assert steps == simulate(config, lengths, 4, timeout_s=60).steps
    waits = [b.aligner.collective_s for b in batchers]
    assert min(waits[r] for r in (0, 1, 3)) > 3 * waits[2], waits
