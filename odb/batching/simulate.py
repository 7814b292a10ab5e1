"""N ranks in one process: run the real batcher and alignment over a :class:`SimulatedGroup`.

Used by ``tools/bench_batching.py`` and the property tests. A simulated sample with ``tokens``
tokens has ``tokens - 1`` label tokens (every position but the first reaches the loss).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from odb.batching.align import SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.plan import StepPlan

__all__ = ["SimulationResult", "make_fetch", "run_ranks", "simulate"]

T = TypeVar("T")


def run_ranks(world_size: int, fn: Callable[[Any], T], timeout_s: float = 120.0) -> list[T]:
    """Runs ``fn(comm)`` for every rank of a fresh :class:`SimulatedGroup`; re-raises a failure."""
    return SimulatedGroup(world_size, timeout_s=timeout_s).run(fn)


def make_fetch(lengths: list[tuple[int, int]]) -> Callable[[list[int]], list[tuple[int, int, int]]]:
    size = len(lengths)

    def fetch(uids: list[int]) -> list[tuple[int, int, int]]:
        out = []
        for uid in uids:
            tokens, patches = lengths[uid % size]
            out.append((tokens, max(0, tokens - 1), patches))
        return out

    return fetch


@dataclass
class SimulationResult:
    steps: list[list[StepPlan]]  # per rank
    batchers: list[OnlineBatcher]
    wall_s: float


def simulate(config: OdbConfig, lengths: list[tuple[int, int]], world_size: int, *,
             shards: list[list[int]] | None = None, num_epochs: int = 1,
             max_steps: int | None = None, timeout_s: float = 300.0) -> SimulationResult:
    """Runs every rank's batcher to the end (or ``max_steps`` steps) over simulated samples."""
    fetch = make_fetch(lengths)
    batchers: list[OnlineBatcher | None] = [None] * world_size

    def rank_main(comm) -> list[StepPlan]:
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), fetch=fetch,
                                num_epochs=num_epochs, shards=shards)
        batchers[comm.rank] = batcher
        steps = []
        for step in batcher:
            steps.append(step)
            if max_steps is not None and len(steps) >= max_steps:
                break
        return steps

    start = time.perf_counter()
    steps = run_ranks(world_size, rank_main, timeout_s=timeout_s)
    return SimulationResult(steps=steps, batchers=batchers, wall_s=time.perf_counter() - start)
