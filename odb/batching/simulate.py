"""N ranks in one process: run the real batcher and alignment over a :class:`SimulatedGroup`.

Used by ``tools/bench/bench_batching.py`` and the property tests. Samples come from a
:class:`SimulatedFeed` per rank, which holds the batcher to the :class:`~odb.batching.batcher.Feed`
protocol as a DataLoader would (every fetched uid was dealt before, in order).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from odb.batching.align import SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.mixture import Mixture
from odb.batching.plan import StepPlan

__all__ = ["SimulatedFeed", "SimulationResult", "run_ranks", "simulate"]

T = TypeVar("T")


def run_ranks(world_size: int, fn: Callable[[Any], T], timeout_s: float = 120.0) -> list[T]:
    """Runs ``fn(comm)`` for every rank of a fresh :class:`SimulatedGroup`; re-raises a failure."""
    return SimulatedGroup(world_size, timeout_s=timeout_s).run(fn)


class SimulatedFeed:
    """A :class:`~odb.batching.batcher.Feed` over fixed samples, one per dataset index.

    Args:
        lengths: ``(tokens, patches)`` per dataset index (a uid reads ``uid % len(lengths)``), or
            ``None`` for a record the data layer skips. A sample with ``tokens`` tokens has
            ``tokens - 1`` label tokens (every position but the first reaches the loss).

    Raises ``AssertionError`` when asked for a uid that was not dealt next (a DataLoader would
    hand out another sample, or wait forever).
    """

    def __init__(self, lengths: Sequence[tuple[int, int] | None]) -> None:
        self.lengths = lengths  # shared by every rank's feed; records are made when fetched
        self.queue: deque[int] = deque()  # dealt, not fetched yet
        self.num_dealt = 0
        self.forgotten: list[int] = []

    def deal(self, uids: list[int]) -> None:
        self.queue.extend(uids)
        self.num_dealt += len(uids)

    def fetch(self, uids: list[int]) -> list[tuple[int, int, int] | None]:
        size, queue, out = len(self.lengths), self.queue, []
        for uid in uids:
            assert queue and queue[0] == uid, f"fetch({uid}) but the next dealt uid is {queue[0] if queue else 'none'}"
            queue.popleft()
            entry = self.lengths[uid % size]
            out.append(None if entry is None else (entry[0], max(0, entry[0] - 1), entry[1]))
        return out

    def forget(self, uids: list[int]) -> None:
        self.forgotten.extend(uids)


@dataclass
class SimulationResult:
    steps: list[list[StepPlan]]  # per rank
    batchers: list[OnlineBatcher]
    wall_s: float
    seconds: list[list[list[float]]] | None = None  # per rank, step, micro-batch: what ``train`` returned


def simulate(config: OdbConfig, lengths: list[tuple[int, int]], world_size: int, *,
             shards: list[list[int]] | None = None, num_epochs: int = 1,
             max_steps: int | None = None, timeout_s: float = 300.0,
             train: Callable[[int, StepPlan], list[float]] | None = None,
             mixture: Callable[[], Mixture] | None = None) -> SimulationResult:
    """Runs every rank's batcher to the end (or ``max_steps`` steps) over simulated samples
    (``(tokens, patches)`` per dataset index, each rank with its own :class:`SimulatedFeed`).
    ``train(rank, step)``: what a rank does with each step, returning each micro-batch's seconds,
    which the batcher observes (the cost fit, ``cost_model: "fit"``) as it would a trainer's
    (one rank runs at a time: its time is its own). ``mixture()``: each rank's
    :class:`~odb.batching.mixture.Mixture` of the records, for a weighted mixture."""
    batchers: list[OnlineBatcher | None] = [None] * world_size
    seconds: list[list[list[float]]] = [[] for _ in range(world_size)]

    def rank_main(comm) -> list[StepPlan]:
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths),
                                num_epochs=num_epochs, shards=shards,
                                mixture=mixture() if mixture is not None else None)
        batchers[comm.rank] = batcher
        steps = []
        for step in batcher:
            steps.append(step)
            if train is not None:
                seconds[comm.rank].append(train(comm.rank, step))
                batcher.observe(step, seconds[comm.rank][-1])
            if max_steps is not None and len(steps) >= max_steps:
                break
        return steps

    start = time.perf_counter()
    steps = run_ranks(world_size, rank_main, timeout_s=timeout_s)
    return SimulationResult(steps=steps, batchers=batchers, wall_s=time.perf_counter() - start,
                            seconds=seconds if train is not None else None)
