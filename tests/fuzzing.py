"""Shared pieces of the randomized fuzzers (tests/sim/test_fuzz_*.py): random settings and data,
the oracles computed from the data alone, and runs that keep every rank's state after every step.

Each fuzzer draws its instances from ``numpy.random.default_rng(seed)`` for a fixed range of
seeds, so a failure names a seed that reproduces it (``instance(seed)`` in the failing test's
module). The oracles never ask the batcher: which records train follows from each record's
length, the caps and ``over_cap`` (:func:`expected_uids`); what a sample holds from its length
and the cap it is cut to (:func:`check_samples`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from conftest import roundtrip
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.cost import sequence_parallel_degrees
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks

__all__ = ["Lengths", "batcher_of", "check_samples", "expected_uids", "plans", "random_config",
           "random_lengths", "redeal_chain", "round_boundaries", "run_states", "trained", "write_shards"]

Lengths = list[tuple[int, int] | None]
"""``(tokens, patches)`` per dataset index, ``None`` for a record the data layer skips."""

TIMEOUT_S = 60.0  # a run of these sizes takes well under a second: a hang fails, it does not wait


def random_config(rng: np.random.Generator, **overrides) -> OdbConfig:
    """Settings drawn at random over what odb accepts: window, gas, lookahead, min_fill,
    max_carry, sharding, policy (the offline baselines with static shards), pad_rows, over_cap
    (sequence_parallel with policy odb), a patch cap, the attention term and the seed."""
    gas = int(rng.integers(1, 5))
    window = int(rng.integers(gas, 40))
    sharding = overrides.get("sharding", str(rng.choice(["static", "dynamic"])))  # (given: what follows fits it)
    policy = overrides.get("policy", str(rng.choice(["odb", "odb", "odb", "fixed"]
                                                    + (["gmt", "bmt"] if sharding == "static" else []))))
    over_cap = overrides.get("over_cap", str(rng.choice(["truncate", "drop"]
                                                        + (["sequence_parallel"] if policy == "odb" else []))))
    values = dict(
        max_tokens=int(rng.integers(50, 400)), window=window, gas=gas, lookahead=int(rng.integers(0, 20)),
        min_fill=float(rng.choice([0.0, rng.random(), 0.99, 1.0])),
        max_carry=float(rng.choice([0.0, rng.random(), 0.5, 1.0])), sharding=sharding, policy=policy,
        over_cap=over_cap, pad_rows=bool(policy == "odb" and over_cap != "sequence_parallel" and rng.random() < 0.2),
        cost_model="manual", attn_coef=float(rng.choice([0.0, 1e-3])), batch_size=int(rng.integers(1, window + 1)),
        bucket_size=int(rng.integers(1, 20)), seed=int(rng.integers(0, 100)),
        max_patches=int(rng.choice([0, 50])) or None, max_sp=int(rng.choice([2, 4, 8])))
    if overrides.get("mode") == "quota" and over_cap == "sequence_parallel":
        values["over_cap"] = "truncate"  # (sequence parallelism is join mode's)
    return OdbConfig(**{**values, **overrides})


def random_lengths(rng: np.random.Generator, max_tokens: int, most: int) -> Lengths:
    """Up to ``most`` records: 10% skipped, 10% over the token cap (up to 5x), the rest within it,
    some with vision patches (0, 10 or 60: over a patch cap of 50)."""
    lengths: Lengths = []
    for _ in range(int(rng.integers(0, most + 1))):
        draw = rng.random()
        if draw < 0.1:
            lengths.append(None)
        elif draw < 0.2:
            lengths.append((int(rng.integers(max_tokens + 1, 5 * max_tokens)), 0))
        else:
            lengths.append((int(rng.integers(1, max_tokens + 1)), int(rng.choice([0, 0, 10, 60]))))
    return lengths


def long_cap(config: OdbConfig, world: int) -> int:
    """The longest sample trained whole: ``max_tokens``, or the largest group's reach under
    over_cap 'sequence_parallel' (the groups: powers of two up to max_sp dividing the ranks)."""
    degrees = sequence_parallel_degrees(config.max_sp, world) if config.over_cap == "sequence_parallel" else ()
    return config.max_tokens * max(degrees, default=1)


def expected_uids(config: OdbConfig, lengths: Lengths, epochs: int, world: int) -> tuple[Counter, int, int]:
    """The uids a join-mode run trains (each once), and how many records it drops over a cap and
    skips, from the lengths and the settings alone."""
    uids, dropped, skipped = Counter(), 0, 0
    reach = long_cap(config, world)
    for epoch in range(epochs):
        for index, entry in enumerate(lengths):
            if entry is None:
                skipped += 1
            elif (config.max_patches is not None and entry[1] > config.max_patches) or (
                    config.over_cap == "drop" and entry[0] > reach):
                dropped += 1
            else:
                uids[epoch * len(lengths) + index] += 1
    return uids, dropped, skipped


def trained(steps: Sequence[Sequence]) -> Counter:
    """How often each uid trained, over every rank's steps."""
    return Counter(u for rank_steps in steps for step in rank_steps for m in step.micro_batches for u in m.uids)


def check_samples(steps: Sequence[Sequence], lengths: Lengths, cap: int) -> None:
    """Each planned sample holds its record's tokens cut to ``cap`` and every position of them but
    the first as a label (SimulatedFeed's samples); each step's N_step and sample count are those
    of its samples over every rank (I4)."""
    size = len(lengths)
    for position in range(len(steps[0])):
        labels = samples = 0
        for rank_steps in steps:
            for micro in rank_steps[position].micro_batches:
                for sample in micro.samples:
                    entry = lengths[sample.uid % size]
                    assert entry is not None, f"uid {sample.uid} is a skipped record, yet it was planned"
                    kept = min(entry[0], cap)
                    assert (sample.tokens, sample.label_tokens) == (kept, kept - 1), (sample, entry, cap)
                    labels += kept - 1
                    samples += 1
        for rank, rank_steps in enumerate(steps):
            step = rank_steps[position]
            assert (step.num_label_tokens, step.num_samples) == (labels, samples), (
                f"rank {rank}, step {position}: N_step {step.num_label_tokens} of {step.num_samples} samples, "
                f"the samples hold {labels} of {samples}")


def plans(steps: Sequence[Sequence]) -> list[list]:
    """What each rank trains, step by step (the numbers and the micro-batches' uids): a resume
    must reproduce it."""
    return [[(s.epoch, s.step, s.num_label_tokens, s.num_samples, [(m.uids, m.shared) for m in s.micro_batches])
             for s in rank_steps] for rank_steps in steps]


def batcher_of(config: OdbConfig, lengths, epochs: int = 1, **kwargs) -> Callable:
    """``comm -> OnlineBatcher`` over a fresh :class:`SimulatedFeed` of ``lengths``; ``mixture``
    (a factory) and ``reader`` (a factory) build one per rank."""
    mixture, reader = kwargs.pop("mixture", None), kwargs.pop("reader", None)

    def make(comm):
        return OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths),
                             num_epochs=epochs, mixture=mixture() if mixture else None,
                             reader=reader() if reader else None, **kwargs)

    return make


def run_states(make: Callable, world: int, states: Sequence[dict] | None = None,
               observe: Callable | None = None) -> tuple[list[list], list[list[dict]], list[OnlineBatcher]]:
    """Every rank of ``make(comm)`` (loaded with ``states[rank]`` first) run to the end: its steps,
    its state (through JSON) before the first step and after each one (index k: after k steps),
    and its batcher. ``observe(step)``: the seconds a step's micro-batches took (the cost fit)."""
    def rank_main(comm):
        batcher = make(comm)
        if states is not None:
            state = roundtrip(states[comm.rank])
            batcher.load_state_dict(state)
            assert state == roundtrip(states[comm.rank]), "load_state_dict changed its input"
        steps, saved = [], [roundtrip(batcher.state_dict())]
        for step in batcher:
            steps.append(step)
            if observe is not None:
                batcher.observe(step, observe(step))
            saved.append(roundtrip(batcher.state_dict()))
        return steps, saved, batcher

    out = run_ranks(world, rank_main, timeout_s=TIMEOUT_S)
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def round_boundaries(states: Sequence[Sequence[dict]]) -> list[int]:
    """The steps after which a rank's queue is empty: a round's steps all trained, the next round
    not run yet (the same on every rank)."""
    return [k for k, state in enumerate(states[0]) if not state["queue"]]


def redeal_chain(make: Callable, full: list[list], states: list[list[dict]], worlds: Sequence[int],
                 rng: np.random.Generator, observe: Callable | None = None) -> tuple[list[list], list[OnlineBatcher]]:
    """The run ``full`` (with its ``states``) stopped after a random step and continued on
    ``worlds[0]`` ranks (re-dealt where the number differs), that one stopped at random and
    continued on ``worlds[1]``, ...: every part's trained steps per rank (the ranks of all parts
    side by side), and the last part's batchers."""
    parts, world = [], len(full)
    for new_world in worlds:
        stop = int(rng.integers(0, len(full[0]) + 1))
        parts.append([rank_steps[:stop] for rank_steps in full])
        at = [rank_states[stop] for rank_states in states]
        at = redeal_states(at, new_world) if new_world != world else at
        full, states, batchers = run_states(make, new_world, at, observe)
        world = new_world
    parts.append(full)
    ranks = max(len(part) for part in parts)
    return [[s for part in parts if r < len(part) for s in part[r]] for r in range(ranks)], batchers


def write_shards(folder, rng: np.random.Generator) -> dict[tuple[int, int], int | None]:
    """1-8 JSONL shards of 0-60 records (blank lines between some, some files without their last
    newline, 10% of records with ``tokens`` null: skipped): each record's ``tokens`` by ``(shard,
    line)``, as written."""
    records = {}
    for shard in range(int(rng.integers(1, 9))):
        lines = []
        for line in range(int(rng.choice([0, 1, 3, 20, 60]))):
            tokens = None if rng.random() < 0.1 else int(rng.integers(1, 400))
            lines.append(json.dumps({"shard": shard, "line": line, "tokens": tokens}))
            records[(shard, line)] = tokens
            if rng.random() < 0.1:
                lines.append("  ")
        (folder / f"part-{shard:02d}.jsonl").write_text("\n".join(lines) + ("\n" if rng.random() < 0.5 else ""))
    return records
