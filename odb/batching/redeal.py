"""Resume on another number of ranks: the untrained samples of a checkpoint, dealt to the new ranks.

odb deals one shared, seeded sample stream, so a checkpoint knows exactly what has not trained:
what every rank holds (its window, its planned but untrained steps) and what it was dealt but has
not fetched (``pending``), plus the stream past ``stream_pos``, which no rank has seen. Every one
of those goes to exactly one new rank; what was trained stays trained::

    old ranks (W1):  held = bins + unpacked + queued steps' samples    pending uids     stream_pos
                          |  by cost, the least loaded new rank first     |  in turn        |
    new ranks (W2):  unpacked (at most ``window`` each; the rest is       pending          the same
                     fetched again, first)

Every rank computes the same new states from the same files (a pure function), and picks its
own. What is per rank and counted over the run (observed costs, over-cap counts) goes to new rank
0, so that every sum over ranks stays what it was; what is the same on every rank (round, step,
epoch) stays. The queued steps were planned for the old ranks: their samples are planned again,
so ``step_index`` and ``num_emitted`` go back by what the queue held.

A streaming source's readers (:class:`odb.batching.stream.Reader`) are dealt too
(:func:`redeal_readers`): the shards still to read, partly read ones first, and the buffered
records, each to one new rank, in turn.

Not supported (``ValueError`` naming what to do instead): static sharding in quota mode (each
rank re-walks its own shard), and states of different runs or versions.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from odb.batching.cost import SampleCost
from odb.batching.mixture import Mixture
from odb.batching.state import STATE_VERSION, upgrade_state

__all__ = ["redeal_readers", "redeal_states"]

_SAME_ON_EVERY_RANK = ("version", "config", "dataset_size", "num_epochs", "epoch", "round_index", "step_index",
                       "stream_pos", "num_emitted", "is_planned")


def _check(states: Sequence[dict[str, Any]]) -> None:
    if not states:
        raise ValueError("no batcher states to re-deal: the checkpoint holds no odb_state.rank<R>.json")
    ranks = [s.get("rank") for s in states]
    if ranks != list(range(len(states))) or any(s.get("world_size") != len(states) for s in states):
        raise ValueError(f"the checkpoint's batcher states are incomplete or mixed (ranks {ranks} of world sizes "
                         f"{sorted({s.get('world_size') for s in states})}); resume from a checkpoint every "
                         "rank finished writing")
    if states[0]["version"] != STATE_VERSION:
        raise ValueError(f"odb batcher state version {states[0]['version']} cannot be re-dealt by this odb "
                         f"(version {STATE_VERSION}); resume with the odb release that wrote it")
    for key in _SAME_ON_EVERY_RANK:
        if any(s[key] != states[0][key] for s in states):
            raise ValueError(f"the checkpoint's ranks disagree on {key!r}: not one run's checkpoint")
    config = states[0]["config"]
    if config.get("sharding") == "static" and config.get("mode") == "quota":
        raise ValueError("static sharding in quota mode cannot resume on another number of ranks (each rank "
                         "re-walks its own shard); resume with the same number of ranks, or use sharding "
                         "'dynamic'")


def redeal_states(states: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The batcher states (``OnlineBatcher.state_dict()``, one per old rank, in rank order) dealt to
    ``world_size`` new ranks: one state per new rank, loadable by a batcher of that world size.
    Never mutates its input.

    Raises:
        ValueError: the states are not one run's, or the run's settings cannot be re-dealt.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    states = [upgrade_state(s) for s in states]  # a version-1 checkpoint's, read as the current layout
    _check(states)
    first, window = states[0], states[0]["config"]["window"]
    size = first["dataset_size"]
    held = [list(row) for s in states for row in (
        [r for b in s["bins"] for r in b] + list(s["unpacked"])
        + [r for step in s["queue"] for micro in step["micro"] for r in micro[1]])]
    queued_steps = len(first["queue"])  # the same on every rank
    queued_samples = sum(len(micro[1]) for s in states for step in s["queue"] for micro in step["micro"])

    # held samples: largest cost first, each to the new rank with the least cost that has room
    unpacked: list[list[list]] = [[] for _ in range(world_size)]
    loads, again = [0] * world_size, []
    for row in sorted(held, key=lambda r: (-r[4], r[0])):
        open_ranks = [r for r in range(world_size) if len(unpacked[r]) < window]
        if not open_ranks:
            again.append(row)  # no room in any window: fetched and measured again
            continue
        r = min(open_ranks, key=lambda q: (loads[q], q))
        unpacked[r].append(row)
        loads[r] += row[4]
    # pending uids (and what had no room), epoch by epoch as the stream gave them, in turn
    pending = sorted([row[0] for row in again] + [u for s in states for u in s["pending"]],
                     key=lambda u: u // size if size else 0)
    observed = [sum(s["observed"][i] for s in states) for i in range(3)]
    observed = [max(0, observed[0] - sum(r[4] for r in again)), max(0, observed[1] - sum(r[4] ** 2 for r in again)),
                observed[2] - len(again)]  # measured again when fetched again (cost_model "fit": prices may
    # have moved since, and the observed figures were scaled, not summed again: never below 0)
    counts: dict[str, int] = {}
    for s in states:
        for key, value in s["counts"].items():
            counts[key] = counts.get(key, 0) + value

    # the cost fit: every rank holds the same window and coefficients; what a rank had not sent yet is lost
    fit = {**copy.deepcopy(first["fit"]), "unsent": []} if first.get("fit") else None
    epoch, is_planned, reopened = first["epoch"], first["is_planned"], False
    if is_planned and first["config"]["mode"] == "join" and held:
        # the queue held the last epoch's last steps: that epoch is not over until they train
        epoch, is_planned, reopened = epoch - 1, False, True
    elif is_planned and held:
        is_planned = False  # quota mode: the queued samples are planned again, up to the quota
    mixtures = redeal_mixture([s.get("mixture") for s in states], again, world_size, closed=reopened)
    readers = redeal_readers([s.get("reader") for s in states], world_size)
    out = []
    for r in range(world_size):
        out.append({
            "version": STATE_VERSION, "world_size": world_size, "rank": r, "config": dict(first["config"]),
            "dataset_size": size, "num_epochs": first["num_epochs"], "epoch": epoch,
            "round_index": first["round_index"], "step_index": first["step_index"] - queued_steps,
            "stream_pos": first["stream_pos"], "num_emitted": first["num_emitted"] - queued_samples,
            "pending": pending[r::world_size], "epoch_of_shard": max(s["epoch_of_shard"] for s in states),
            "bins": [], "unpacked": sorted(unpacked[r], key=lambda row: row[0]), "queue": [],
            "observed": observed if r == 0 else [0, 0, 0],
            "counts": counts if r == 0 else dict.fromkeys(counts, 0), "is_planned": is_planned,
            "fit": fit, "mixture": mixtures[r], "reader": readers[r],
        })
    return out


def redeal_readers(readers: Sequence[dict[str, Any] | None], world_size: int) -> list[dict[str, Any] | None]:
    """A streaming source's reader states (one per old rank; ``None``: no streaming source) dealt
    to ``world_size`` new ranks: every shard still to read (partly read ones first, each from the
    byte offset it was read to) and every buffered uid goes to exactly one new rank, in turn."""
    if all(r is None for r in readers):
        return [None] * world_size
    if any(r is not None and "mixed" in r for r in readers):
        raise ValueError(f"a streamed mixture was saved by {len(readers)} data-parallel ranks, each drawing it from "
                         f"its own shards and measures: resume it on {len(readers)} ranks (or restart it)")
    if any(r is None for r in readers) or len({r["pass"] for r in readers}) != 1:
        raise ValueError("the checkpoint's ranks disagree on their streaming readers: not one run's checkpoint")
    segments = [list(s) for r in readers for s in r["segments"]]
    segments = [s for s in segments if s[1] > 0] + [s for s in segments if s[1] == 0]
    buffered = [u for r in readers for u in r["buffer"]]
    draws = max(r["draws"] for r in readers)
    return [{"pass": readers[0]["pass"], "segments": segments[r::world_size], "buffer": buffered[r::world_size],
             "draws": draws} for r in range(world_size)]


def redeal_mixture(states: Sequence[Mapping[str, Any] | None], again: Sequence[Sequence[int]],
                   world_size: int, *, closed: bool) -> list[dict[str, Any] | None]:
    """The mixture's part of :func:`redeal_states`: the same on every new rank
    but for the counts, which new rank 0 takes summed (minus ``again``: held samples the new ranks
    fetch and count again, rows ``[uid, tokens, label_tokens, ...]``), so every sum stays.
    ``closed``: the states' epoch was over and is reopened for its queued samples alone (the
    mixture had already started the next): nothing more is drawn in it."""
    if states[0] is None:
        return [None] * world_size
    first = states[0]
    sizes, mix_by, counts = first["sizes"], first["mix_by"], list(first["mine"])
    mine = {k: [sum(s["mine"][k][i] for s in states) for i in range(len(sizes))] for k in counts}
    if not closed:  # (a closed epoch's counts were reset when the next began: nothing to take back)
        uncounted = Mixture(sizes, [1.0] * len(sizes), mix_by=mix_by)
        uncounted.first_pass = list(first["first_pass"])
        uncounted.observe([row[0] for row in again], [SampleCost(*row) for row in again])
        mine = {k: [a - b for a, b in zip(mine[k], uncounted.mine[k])] for k in counts}
    zero = {k: [0] * len(sizes) for k in counts}
    return [{**dict(first), "mine": mine if r == 0 else zero, "closed": closed or first["closed"]}
            for r in range(world_size)]
