"""Packing a rank's window of processed samples into micro-batch bins.

:class:`OnlinePacker` is odb's packer. It is not best-fit decreasing (which would put each
sample, largest first, into the fullest open bin it fits): it fills one bin at a time from a
pool sorted by tokens. Each round the pool is the new samples plus those of the bins that were
not full enough last round (those bins are dissolved; full ones stay as they are). A bin opens
with the largest sample left; while even the largest one left fits, a random one joins (seeded
by the pool's smallest sample, so the plan is deterministic; it leaves large and small samples
for the later bins); once not, the largest that still fits joins, until none does; then, up to
``max_swaps`` times, the one swap that gains most tokens: a sample of the bin out, the largest
pool sample that fits in its place in. Never above ``max_tokens`` (or ``max_patches``). Bins
under ``min_fill`` may wait in the window for the next round's samples (carry, never drop), up
to ``max_carry`` of the window; if a step needs more bins than there are (GAS), the bins with
the most samples are split in half. No length cache: only samples already processed are packed.

For a model that cannot pack, ``OnlinePacker(..., padded=True)`` forms padded bins instead: rows
of similar length with ``len(samples) * longest <= max_tokens``.

The padded baselines (``fixed``, ``gmt``, ``bmt``) implement the same small interface
(:class:`Packer`) so that the alignment, plans and benchmark treat every policy alike.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable

from odb.batching.cost import CostModel, SampleCost

__all__ = ["Bin", "BmtPacker", "FixedPacker", "GmtPacker", "OnlinePacker", "Packer", "make_packer"]


class Bin:
    """Samples that go through the model together as one micro-batch."""

    __slots__ = ("cost", "longest", "padded", "patches", "rows", "samples", "tokens")

    def __init__(self, padded: bool = False) -> None:
        self.samples: list[SampleCost] = []
        self.tokens = 0
        self.patches = 0
        self.cost = 0
        self.longest = 0  # the longest sequence (a sample's, or one of a pair's: SampleCost.longest)
        self.rows = 0  # padded rows: one a sequence (a pair is two)
        self.padded = padded

    @classmethod
    def of(cls, samples: Iterable[SampleCost], cost_model: CostModel, padded: bool = False) -> Bin:
        new = cls(padded)
        new.samples = chosen = list(samples)
        for sample in chosen:
            new.tokens += sample.tokens
            new.patches += sample.patches
            new.cost += sample.cost
            new.rows += sample.rows
        new.longest = max((s.longest for s in chosen), default=0)
        if padded:
            new.cost = cost_model.padded_cost(new.rows, new.longest)
        return new

    def add(self, sample: SampleCost) -> None:
        self.samples.append(sample)
        self.tokens += sample.tokens
        self.patches += sample.patches
        self.cost += sample.cost
        self.rows += sample.rows
        self.longest = max(self.longest, sample.longest)

    @property
    def materialized(self) -> int:
        """Tokens the model processes, padding included (padded: every row as long as the longest)."""
        return self.rows * self.longest if self.padded else self.tokens

    def split(self, keep: int, cost_model: CostModel) -> tuple[Bin, Bin]:
        """The first ``keep`` samples and the rest, as two bins (quota closure uses it)."""
        return (Bin.of(self.samples[:keep], cost_model, self.padded),
                Bin.of(self.samples[keep:], cost_model, self.padded))

    def cost_steps(self, cost_model: CostModel) -> list[int]:
        """Per-sample cost increments: the first k sum to ``split(k)[0].cost``, the cost of the
        first k samples as one bin (a padded bin's cost grows with its longest row)."""
        if not self.padded:
            return [s.cost for s in self.samples]
        steps, before, longest, rows = [], 0, 0, 0
        for sample in self.samples:
            longest, rows = max(longest, sample.longest), rows + sample.rows
            now = cost_model.padded_cost(rows, longest)
            steps.append(now - before)
            before = now
        return steps


class Packer:
    """Interface: :meth:`add` processed samples, :meth:`pack` them into ``bins`` (ordered, the ones
    to train first first; it returns how many are ready now), :meth:`take` those the round trains.
    ``is_offline`` packers need the whole shard before they form a bin."""

    is_offline = False

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.bins: list[Bin] = []
        self.unpacked: list[SampleCost] = []  # added, not in a bin yet

    @property
    def num_samples(self) -> int:
        return sum(len(b.samples) for b in self.bins) + len(self.unpacked)

    def add(self, samples: list[SampleCost]) -> None:
        self.unpacked.extend(samples)

    def pack(self, window: int, is_exhausted: bool, min_bins: int = 1) -> int:
        """Packs what was added into ``self.bins``, orders them (the ones to train first first) and
        returns how many may be trained now: all of them once ``is_exhausted`` (no more input this
        epoch). Online packers make at least ``min_bins`` bins when they hold that many samples.

        Args:
            window: the window size (the packer's carry allowance is a fraction of it).
            is_exhausted: this rank expects no more samples this epoch.
            min_bins: GAS: a step needs that many micro-batches (split rather than pad).
        """
        raise NotImplementedError

    def take(self, indices: Iterable[int]) -> dict[int, Bin]:
        """The bins at ``indices`` (of :attr:`bins`), by index; the others stay, in order."""
        chosen = set(indices)
        taken = {i: b for i, b in enumerate(self.bins) if i in chosen}
        self.bins = [b for i, b in enumerate(self.bins) if i not in chosen]
        return taken

    def held(self) -> list[SampleCost]:
        """The samples it holds: its bins', in order, then those not in a bin yet."""
        return [s for b in self.bins for s in b.samples] + self.unpacked

    def reprice(self) -> None:
        """Every held sample priced again by the cost model (its coefficients changed)."""
        price = self.cost_model.reprice
        self.restore([[price(s) for s in b.samples] for b in self.bins], [price(s) for s in self.unpacked])

    def restore(self, bins: list[list[SampleCost]], unpacked: list[SampleCost]) -> None:
        self.bins = [Bin.of(samples, self.cost_model, self.padded) for samples in bins]
        self.unpacked = list(unpacked)

    padded = False


class OnlinePacker(Packer):
    """Bin by bin from a pool sorted by tokens (the module docstring says how a bin is filled);
    bins under ``min_fill`` wait (carry) and go back to the pool with the next samples, up to
    ``max_carry`` of the window. Bins are ordered full ones first, then by tokens (descending).

    Padded (``padded=True``, for a model that cannot pack): each bin takes the largest sample of
    the pool and the next largest after it, as many rows as ``max_tokens // longest`` allows, so
    ``len(samples) * longest <= max_tokens``; a bin is full when no further row fits.

    Args:
        cost_model: the caps and costs.
        min_fill: a bin at least this full (fraction of ``max_tokens``) may be trained now.
        max_carry: at most this fraction of the window's samples waits in bins under ``min_fill``;
            beyond it the fullest of them are trained anyway, so every round makes progress.
        padded: form padded bins (rows padded to the longest) instead of packed rows.
    """

    max_swaps = 4  # improvement passes per bin; each one only ever fills the bin further

    def __init__(self, cost_model: CostModel, *, min_fill: float, max_carry: float, padded: bool = False) -> None:
        super().__init__(cost_model)
        self.min_fill_tokens = min_fill * cost_model.max_tokens
        self.max_carry = max_carry
        self.padded = padded

    def is_full(self, current: Bin) -> bool:
        """Whether ``current`` may be trained now (it is at least ``min_fill`` full, or padded with
        no room for another row)."""
        if current.tokens >= self.min_fill_tokens:
            return True
        return current.padded and (len(current.samples) + 1) * current.longest > self.cost_model.max_tokens

    def pack(self, window: int, is_exhausted: bool, min_bins: int = 1) -> int:
        keep = [b for b in self.bins if self.is_full(b)]
        pool = [s for b in self.bins if not self.is_full(b) for s in b.samples] + self.unpacked
        self.unpacked = []
        self.bins = keep + (padded_groups(pool, self.cost_model) if self.padded else self._pack(pool))
        while len(self.bins) < min_bins:  # a step needs GAS micro-batches: split rather than pad
            largest = max(self.bins, key=lambda b: len(b.samples), default=None)
            if largest is None or len(largest.samples) < 2:
                break
            self.bins.remove(largest)
            self.bins += largest.split(len(largest.samples) // 2, self.cost_model)
        self.bins.sort(key=lambda b: (not self.is_full(b), -b.tokens, b.samples[0].uid))  # full ones first
        if is_exhausted:
            return len(self.bins)
        ready = sum(1 for b in self.bins if self.is_full(b))
        carry_allowed = int(self.max_carry * window)
        carried = 0
        first_carried = len(self.bins)
        while first_carried > 0 and carried + len(self.bins[first_carried - 1].samples) <= carry_allowed:
            first_carried -= 1
            carried += len(self.bins[first_carried].samples)
        return max(ready, first_carried)

    def _pack(self, pool: list[SampleCost]) -> list[Bin]:
        """Packed bins, one at a time: the largest sample left opens it; a random one joins while
        the largest left fits, then the largest that fits; then swaps that fill the gap."""
        cap = self.cost_model.max_tokens
        cap_patches = self.cost_model.max_patches
        items = sorted(pool, key=lambda s: (s.tokens, s.uid))
        sizes = [s.tokens for s in items]
        bins = []
        rng = random.Random(items[0].uid if items else 0)
        bisect_right, draw = bisect.bisect_right, rng.random
        while items:
            tokens = sizes.pop()
            first = items.pop()
            chosen, patches = [first], first.patches
            while items:
                free = cap - tokens
                if free >= sizes[-1]:  # anything fits: a random one keeps the pool representative
                    i = int(draw() * len(items))
                else:  # the largest sample that still fits
                    i = bisect_right(sizes, free) - 1
                if cap_patches is not None:
                    while i >= 0 and patches + items[i].patches > cap_patches:
                        i -= 1
                if i < 0:
                    break
                tokens += sizes.pop(i)
                sample = items.pop(i)
                patches += sample.patches
                chosen.append(sample)
            current = Bin.of(chosen, self.cost_model)
            for _ in range(self.max_swaps):  # swap one sample for a larger one from the pool
                if not self._swap(current, items, sizes, cap, cap_patches):
                    break
            bins.append(current)
        return bins

    @staticmethod
    def _swap(current: Bin, items: list[SampleCost], sizes: list[int], cap: int,
              cap_patches: int | None) -> bool:
        """Swaps the bin sample whose replacement (the largest pool sample that fits in its place)
        gains most tokens; False when no swap gains any."""
        free = cap - current.tokens
        if not free or not items:
            return False
        best_gain, best = 0, None
        for k, sample in enumerate(current.samples):
            j = bisect.bisect_right(sizes, sample.tokens + free) - 1
            if j < 0 or sizes[j] - sample.tokens <= best_gain:
                continue
            if cap_patches is not None and current.patches - sample.patches + items[j].patches > cap_patches:
                continue
            best_gain, best = sizes[j] - sample.tokens, (k, j)
        if best is None:
            return False
        k, j = best
        incoming = items.pop(j)
        sizes.pop(j)
        outgoing = current.samples.pop(k)
        current.tokens -= outgoing.tokens
        current.patches -= outgoing.patches
        current.cost -= outgoing.cost
        current.rows -= outgoing.rows
        current.add(incoming)
        current.longest = max(s.longest for s in current.samples)
        at = bisect.bisect_left(sizes, outgoing.tokens)
        sizes.insert(at, outgoing.tokens)
        items.insert(at, outgoing)
        return True


class FixedPacker(Packer):
    """Baseline: ``batch_size`` samples per micro-batch in arrival order, padded to the longest."""

    padded = True

    def __init__(self, cost_model: CostModel, *, batch_size: int) -> None:
        super().__init__(cost_model)
        self.batch_size = batch_size

    def pack(self, window: int, is_exhausted: bool, min_bins: int = 1) -> int:
        # (samples restored unpacked, e.g. re-dealt from another world size, are batched here too)
        size, full = self.batch_size, len(self.unpacked) // self.batch_size * self.batch_size
        self.bins += [Bin.of(self.unpacked[i:i + size], self.cost_model, padded=True) for i in range(0, full, size)]
        del self.unpacked[:full]
        if is_exhausted and self.unpacked:
            self.bins.append(Bin.of(self.unpacked, self.cost_model, padded=True))
            self.unpacked = []
        return len(self.bins)


def padded_groups(samples: list[SampleCost], cost_model: CostModel) -> list[Bin]:
    """Padded bins from ``samples`` sorted longest first: each opens with the longest left and
    takes the next ones while ``len(group) * longest <= max_tokens`` (and the patch cap) holds."""
    cap, cap_patches = cost_model.max_tokens, cost_model.max_patches
    bins: list[Bin] = []
    group: list[SampleCost] = []
    patches = 0
    for sample in sorted(samples, key=lambda s: (-s.tokens, s.uid)):
        fits = (len(group) + 1) * (group[0].tokens if group else sample.tokens) <= cap
        if group and not (fits and (cap_patches is None or patches + sample.patches <= cap_patches)):
            bins.append(Bin.of(group, cost_model, padded=True))
            group, patches = [], 0
        group.append(sample)
        patches += sample.patches
    if group:
        bins.append(Bin.of(group, cost_model, padded=True))
    return bins


class GmtPacker(Packer):
    """Baseline: offline global token budget (fairseq ``max_tokens``): all lengths first, sorted,
    padded groups with ``len(group) * longest <= max_tokens``."""

    is_offline = True
    padded = True

    def _group(self, samples: list[SampleCost]) -> None:
        self.bins += padded_groups(samples, self.cost_model)

    def pack(self, window: int, is_exhausted: bool, min_bins: int = 1) -> int:
        if not is_exhausted:
            return 0
        if self.unpacked:
            self._group(self.unpacked)
            self.unpacked = []
        return len(self.bins)


class BmtPacker(GmtPacker):
    """Baseline: offline, sorted within buckets of ``bucket_size`` samples (in arrival order),
    padded groups under the token budget inside each bucket."""

    def __init__(self, cost_model: CostModel, *, bucket_size: int) -> None:
        super().__init__(cost_model)
        self.bucket_size = bucket_size

    def pack(self, window: int, is_exhausted: bool, min_bins: int = 1) -> int:
        if not is_exhausted:
            return 0
        for start in range(0, len(self.unpacked), self.bucket_size):
            self._group(self.unpacked[start:start + self.bucket_size])
        self.unpacked = []
        return len(self.bins)


def make_packer(config, cost_model: CostModel) -> Packer:
    """The packer of ``config.policy`` (``pad_rows`` pads odb's bins; the baselines pad anyway)."""
    if config.policy in ("gmt", "bmt") and config.sharding != "static":
        raise ValueError(f"policy {config.policy!r} needs every length of its shard first; set sharding 'static'")
    if config.policy == "odb":
        return OnlinePacker(cost_model, min_fill=config.min_fill, max_carry=config.max_carry,
                            padded=config.pad_rows)
    if config.policy == "fixed":
        return FixedPacker(cost_model, batch_size=config.batch_size)
    if config.policy == "gmt":
        return GmtPacker(cost_model)
    return BmtPacker(cost_model, bucket_size=config.bucket_size)
