"""Phase 4 of the round decision (:mod:`odb.batching.decide`): which bin each rank trains at which
micro-batch slot.

Each rank's taken bins go to slots by cost, descending, then one permutation of the slots shared
by all ranks (:func:`assign_slots`): the micro-batches that meet at each ZeRO sync point cost about
the same. Long bins first (:func:`place_long`, over_cap 'sequence_parallel'): a bin of one sample
over ``max_tokens`` is trained by the aligned group of ``d`` consecutive ranks that holds its rank,
at the first position where every rank of the group is free. A bin cut by the quota counts with
the samples it keeps (:func:`bin_figures`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from odb.batching.cost import group_for
from odb.batching.gathered import Gathered, first_bins, round_up

__all__ = ["BinFigures", "LongPlacement", "assign_slots", "bin_figures", "place_long"]


class BinFigures(NamedTuple):
    """Per ranked bin ``[world, B]``, as trained this round (a cut bin: the samples it keeps)."""

    costs: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    samples: np.ndarray


def bin_figures(g: Gathered, cut: tuple[int, int, int] | None) -> BinFigures:
    """Costs, tokens, label tokens and samples of each ranked bin; a cut bin's from the samples it
    keeps (its first ``keep``: per-sample figures, exact, never pro-rated)."""
    if cut is None:
        return BinFigures(g.costs, g.tokens, g.labels, g.samples)  # (read only)
    assert g.sample_tokens is not None, "quota mode proposals carry per-sample labels, tokens and costs"
    figures = BinFigures(g.costs.copy(), g.tokens.copy(), g.labels.copy(), g.samples.copy())
    r, b, keep = cut
    start = int(g.samples[r, :b].sum())  # (the samples lie bin after bin)
    kept = slice(start, start + keep)
    figures.costs[r, b] = g.sample_costs[r, kept].sum()
    figures.tokens[r, b] = g.sample_tokens[r, kept].sum()
    figures.labels[r, b] = g.sample_labels[r, kept].sum()
    figures.samples[r, b] = keep
    return figures


class LongPlacement(NamedTuple):
    """The long bins placed this round: ``position[r, b]`` of rank r's bin b (-1: not a long bin
    placed), and ``owner[r, p]``: the owner of the long bin a group trains at position p that
    holds rank r, or -1."""

    position: np.ndarray  # [world, B]
    owner: np.ndarray  # [world, T]


def place_long(bin_tokens: np.ndarray, take: np.ndarray, ready: np.ndarray, target: int, gas: int,
                is_drain: bool, max_tokens: int, degrees: tuple[int, ...], first: int = 0
                ) -> tuple[np.ndarray, int, LongPlacement]:
    """Places each taken long bin on its group at one position (the module docstring, phase 4);
    returns the bins each rank trains (``[world, B]``: its placed long bins, then as many of its
    ``ready`` bins as its free positions hold, fullest first), ``T`` (grown in the drain round to
    hold every bin) and the placement. Ranks take turns at going first (``first``: the round)."""
    world, width = bin_tokens.shape
    over = bin_tokens > max_tokens
    taken = first_bins(take, bin_tokens)
    limit = target if not is_drain else round_up(width * world + 1, max(gas, 1))  # (a drain round: room for all)
    busy = np.zeros((world, limit), dtype=bool)
    position = np.full((world, width), -1, dtype=np.int64)
    owner = np.full((world, limit), -1, dtype=np.int64)
    ranks, bins = np.nonzero(taken & over)
    for b, _, r in sorted(zip(bins.tolist(), ((ranks - first) % world).tolist(), ranks.tolist())):
        # (each rank's first long bin, then each one's second, ...)
        d = group_for(int(bin_tokens[r, b]), max_tokens, degrees)
        group = slice(r // d * d, r // d * d + d)
        free = np.flatnonzero(~busy[group].any(axis=0))
        if not len(free):
            continue  # it waits for the next round (its rank's other bins may still go)
        p = int(free[0])
        busy[group, p] = True
        position[r, b], owner[group, p] = p, r
    placed = position >= 0
    ordinary = ~over & (np.arange(width)[None, :] < ready[:, None])
    room = limit - busy.sum(axis=1)
    trained = placed | (ordinary & (np.cumsum(ordinary, axis=1) <= room[:, None]))
    if is_drain:
        assert (placed == (taken & over)).all(), "a drain round has room for every long bin"
        used = np.flatnonzero(busy.any(axis=0))  # (a group may wait past its ranks' own counts)
        T = round_up(max(int((busy.sum(axis=1) + ordinary.sum(axis=1)).max()), int(used[-1]) + 1 if len(used) else 0),
                      gas)
    else:
        T = target
    return trained, T, LongPlacement(position, owner[:, :T])


def assign_slots(bin_costs: np.ndarray, taken: np.ndarray, target: int, shuffle: np.random.Generator | None,
           long: LongPlacement | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``[world, T]``: the bins each rank trains (``taken``, ``[world, B]``) by cost (descending),
    then dummies (-1); then the positions permuted by ``shuffle`` (the same permutation on every
    rank). With ``long`` (:func:`place_long`), its long bins at their positions first, and the
    groups' owners at the same positions (``[world, T]``, else None)."""
    world = len(taken)
    width = int(np.flatnonzero(taken.any(axis=0))[-1]) + 1 if taken.any() else 0
    taken = taken[:, :width]
    slots = np.full((world, target), -1, dtype=np.int64)
    if long is None:
        order = np.argsort(np.where(taken, -bin_costs[:, :width], 1), axis=1, kind="stable")
        slots[:, :width] = np.where(np.take_along_axis(taken, order, 1), order, -1)
        owner = None
    else:
        owner = long.owner
        for r in range(world):
            is_long = long.position[r, :width] >= 0
            slots[r, long.position[r, :width][is_long]] = np.flatnonzero(is_long)
            rest = [b for b in np.argsort(-bin_costs[r, :width], kind="stable") if taken[r, b] and not is_long[b]]
            free = np.flatnonzero(owner[r] < 0)[:len(rest)]
            slots[r, free] = rest
    if target and shuffle is not None:
        permutation = shuffle.permutation(target)
        slots = slots[:, permutation]
        owner = None if owner is None else owner[:, permutation]
    return slots, owner
