"""What a processed sample costs: the budget object the packer consults.

The packer never looks at tensors, only at :class:`SampleCost` records. Every number that says
"how full is full" lives here (token cap, patch cap, the quadratic attention term), so the packer
holds no constants of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from odb.batching.feed import Sizes

__all__ = ["CostModel", "OverCapError", "SampleCost", "count_label_tokens", "group_for", "sequence_parallel_degrees"]


class OverCapError(ValueError):
    """A sample exceeds the micro-batch cap and the over-cap policy is 'error'."""


class SampleCost(NamedTuple):
    """One processed sample as the packer sees it.

    Attributes:
        uid: position in the run's sample stream (``epoch * dataset_size + dataset_index``).
        tokens: tokens in ``input_ids`` (visual tokens already expanded), after any truncation.
        label_tokens: labels that count in the loss (see :func:`count_label_tokens`).
        patches: vision-encoder patches (0 for text).
        cost: compute estimate used to balance ranks; see :meth:`CostModel.cost`.
        second: a sample of two sequences (a preference pair: chosen, then rejected, each its own
            segment packed, its own row padded): the second's tokens, the first's being
            ``tokens - second``; 0 for a sample of one sequence.
    """

    uid: int
    tokens: int
    label_tokens: int
    patches: int
    cost: int
    second: int = 0

    @property
    def rows(self) -> int:
        """Rows the sample takes in a padded micro-batch: one a sequence."""
        return 2 if self.second else 1

    @property
    def longest(self) -> int:
        """Tokens of its longest sequence, the length a padded micro-batch pads its rows to."""
        return max(self.tokens - self.second, self.second)

    @property
    def area(self) -> int:
        """The sum of its sequences' squared lengths: what its attention costs packed."""
        first = self.tokens - self.second
        return first * first + self.second * self.second


def sequence_parallel_degrees(max_sp: int, world_size: int) -> tuple[int, ...]:
    """The groups of ranks that may train one long sample together (over_cap
    'sequence_parallel'): the powers of two from 2 up to ``max_sp`` that divide ``world_size``
    (aligned blocks of consecutive ranks, each group of one size inside one of the next)."""
    degrees, d = [], 2
    while d <= min(max_sp, world_size) and world_size % d == 0:
        degrees.append(d)
        d *= 2
    return tuple(degrees)


def group_for(tokens: int, max_tokens: int, degrees: tuple[int, ...]) -> int:
    """How many ranks train a sample of ``tokens`` together: 1 within ``max_tokens`` (or without
    ``degrees``), else the smallest of ``degrees`` (ascending) that holds it at ``max_tokens`` a rank,
    the largest for one that none holds (it is cut to that group's reach)."""
    if tokens <= max_tokens or not degrees:
        return 1
    return next((d for d in degrees if tokens <= d * max_tokens), degrees[-1])


def count_label_tokens(labels: Sequence[int]) -> int:
    """Labels that reach the loss once packed: the first position of a sample never does (odb's
    collate masks it so that it cannot be predicted from the previous sample), nor does -100."""
    return sum(1 for label in labels[1:] if label != -100)


class CostModel:
    """Tokens, label tokens, patches and compute cost of a sample, and the caps of a micro-batch.

    ``cost = tokens + attn_coef * sum(L**2) + patch_coef * patches`` (rounded to an int), ``L``
    over the sample's sequences (one, or a pair's two: :attr:`SampleCost.second`): the linear term
    is the MLP/projection work, the quadratic one the attention of varlen packing, where each
    sequence attends only to itself (a pair of ``c`` and ``r`` tokens: ``c**2 + r**2``, not
    ``(c + r)**2``).
    """

    def __init__(self, *, max_tokens: int, max_patches: int | None = None, attn_coef: float = 0.0,
                 patch_coef: float = 0.0, over_cap: str = "truncate", degrees: tuple[int, ...] = (),
                 a2a_coef: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.max_patches = max_patches
        self.attn_coef = attn_coef
        self.patch_coef = patch_coef
        self.over_cap = over_cap
        self.degrees = tuple(sorted(degrees)) if over_cap == "sequence_parallel" else ()
        self.a2a_coef = a2a_coef
        self.long_cap = max_tokens * max(self.degrees, default=1)
        """The longest sample admitted whole: ``max_tokens``, or the largest group's under
        over_cap 'sequence_parallel'."""

    @classmethod
    def from_config(cls, config, degrees: tuple[int, ...] = ()) -> CostModel:
        """The cost model of ``config``; ``degrees``: the groups of ranks that may train one long
        sample together (over_cap 'sequence_parallel', :func:`sequence_parallel_degrees`)."""
        if not config.is_resolved:
            raise ValueError("max_tokens / max_patches 'auto' must be resolved before batching (the trainer's "
                             "preflight measures them); pass numbers")
        return cls(max_tokens=config.max_tokens, max_patches=config.max_patches, attn_coef=config.attn_coef,
                   patch_coef=config.patch_coef, over_cap=config.over_cap, degrees=degrees,
                   a2a_coef=config.a2a_coef)

    def set_coefficients(self, attn_coef: float, patch_coef: float, a2a_coef: float | None = None) -> None:
        """New coefficients (``cost_model: "fit"``, :mod:`odb.batching.fit`): samples measured from
        now on are priced with them; those already held are the caller's to price again."""
        self.attn_coef, self.patch_coef = attn_coef, patch_coef
        if a2a_coef is not None:
            self.a2a_coef = a2a_coef

    def degree(self, tokens: int) -> int:
        """How many ranks train a sample of ``tokens`` together: 1 within ``max_tokens``, else the
        smallest group that holds it at ``max_tokens`` a rank (over_cap 'sequence_parallel')."""
        return group_for(tokens, self.max_tokens, self.degrees)

    def reprice(self, sample: SampleCost) -> SampleCost:
        """``sample`` priced with the coefficients now in effect; a long one that the largest group
        no longer holds (a resume on fewer ranks) cut to ``long_cap``, as the data layer cuts it
        when it processes the sample again."""
        if self.over_cap == "sequence_parallel" and sample.tokens > self.long_cap:
            sample = sample._replace(tokens=self.long_cap, label_tokens=min(sample.label_tokens, self.long_cap - 1))
        return sample._replace(cost=self.cost(sample.tokens, sample.patches, sample.second))

    def cost(self, tokens: int, patches: int = 0, second: int = 0) -> int:
        """The cost of a sample on each rank that trains it (``second``: a pair's second sequence,
        :class:`SampleCost`): a long sample's (over_cap 'sequence_parallel') is its whole cost and
        the all-to-all's, ``a2a_coef * tokens``, shared by its group's ``d`` ranks (each holds
        ``tokens / d`` and attends with ``1 / d`` of the heads over the whole sample)."""
        degree = self.degree(tokens)
        if degree == 1 and not (self.attn_coef or self.patch_coef):
            return tokens
        first = tokens - second
        whole = tokens + self.attn_coef * (first * first + second * second) + self.patch_coef * patches
        if degree > 1:
            whole = (whole + self.a2a_coef * tokens) / degree
        return int(round(whole))

    def padded_cost(self, rows: int, longest: int) -> int:
        """Cost of a padded micro-batch of ``rows`` rows (a sample's sequences, one row each: a
        pair is two), every row as long as the longest sequence, ``longest``."""
        return rows * self.cost(longest)

    def measure_again(self, sample: SampleCost, sizes: tuple) -> SampleCost:
        """``sample`` as the data layer gives its sizes now (:class:`~odb.batching.feed.Sizes`, or a
        plain tuple of its first fields): itself where they are the same as planned, else measured
        again (it was admitted once, so it is again)."""
        now = Sizes(*sizes)
        if (now.tokens, now.label_tokens, now.patches, now.second) == (sample.tokens, sample.label_tokens,
                                                                       sample.patches, sample.second):
            return sample
        measured, _ = self.measure(sample.uid, *now)
        assert measured is not None, f"sample {sample.uid} no longer fits ({now}): it was admitted once"
        return measured

    def measure_many(self, uids: list[int], raw: list[tuple | None]
                     ) -> tuple[list[SampleCost], dict[str, int]]:
        """:meth:`measure` for each ``(tokens, label_tokens, patches)``, ``(tokens, label_tokens,
        patches, labels)`` or ``(tokens, label_tokens, patches, labels, second)`` (``None``: a record
        the data layer skipped; see :class:`~odb.batching.feed.Feed`): the admitted samples and how
        many were truncated (and the tokens cut from them), dropped, skipped."""
        admitted: list[SampleCost] = []
        outcomes = {"truncated": 0, "truncated_tokens": 0, "dropped": 0, "skipped": 0, "long": 0}
        cap, cap_patches = self.max_tokens, self.max_patches
        is_linear = not (self.attn_coef or self.patch_coef)
        for uid, entry in zip(uids, raw, strict=True):
            if entry is None:  # the data layer skipped the record (and counted why)
                outcomes["skipped"] += 1
                continue
            tokens, label_tokens, patches = entry[:3]
            if is_linear and 0 < tokens <= cap and 0 <= label_tokens <= tokens and (
                    cap_patches is None or patches <= cap_patches):
                admitted.append(SampleCost(uid, tokens, label_tokens, patches, tokens,  # fast path
                                           entry[4] if len(entry) > 4 else 0))
                continue
            sample, outcome = self.measure(uid, *entry)
            if sample is not None:
                admitted.append(sample)
            if outcome != "ok":
                outcomes[outcome] += 1
            if outcome == "truncated":
                outcomes["truncated_tokens"] += tokens - self.long_cap
        return admitted, outcomes

    def measure(self, uid: int, tokens: int, label_tokens: int, patches: int = 0,
                labels: Sequence[int] | None = None, second: int = 0) -> tuple[SampleCost | None, str]:
        """The sample's cost record and what the over-cap policy did: 'ok', 'truncated', 'dropped',
        or 'long' (over ``max_tokens``, trained whole by a group of ranks: over_cap
        'sequence_parallel'). ``second``: a pair's second sequence (:class:`SampleCost`).

        A dropped sample returns ``None``. Truncation keeps the first ``max_tokens`` tokens
        (``long_cap`` under 'sequence_parallel'; the collate does the same to the tensors); a sample
        over the patch cap cannot be truncated (an image is not cut), so under 'truncate' it is dropped.

        A cut sample trains the label tokens of the prefix it keeps: counted from ``labels`` (the
        sample's labels, -100 where none) when given; without them the count is exact only where
        every position is a label or none is, and any other cut sample raises
        :class:`OverCapError` (a prompt's share of the prefix is unknown), as does a pair over the
        cap that is to be cut (the data layer cuts a pair at its answers' ends, never here).
        """
        if tokens < 1:
            raise ValueError(f"sample {uid} is empty (0 tokens); the data layer must skip it")
        if label_tokens < 0 or label_tokens > tokens:
            raise ValueError(f"sample {uid}: label_tokens={label_tokens} is not within [0, {tokens}]")
        if not 0 <= second < tokens:
            raise ValueError(f"sample {uid}: its second sequence's {second} tokens are not within [0, {tokens})")
        over_tokens = tokens > self.max_tokens
        over_patches = self.max_patches is not None and patches > self.max_patches
        if not (over_tokens or over_patches):
            return SampleCost(uid, tokens, label_tokens, patches, self.cost(tokens, patches, second), second), "ok"
        if over_tokens and not over_patches and self.degrees and tokens <= self.long_cap:
            return SampleCost(uid, tokens, label_tokens, patches, self.cost(tokens, patches, second), second), "long"
        if self.over_cap == "error":
            what = (f"{tokens} tokens > max_tokens={self.max_tokens}" if over_tokens
                    else f"{patches} patches > max_patches={self.max_patches}")
            raise OverCapError(f"sample {uid} has {what}; raise the cap or set over_cap to "
                               "'truncate' or 'drop'")
        if self.over_cap == "drop" or over_patches:
            return None, "dropped"
        if second:
            raise OverCapError(f"pair {uid} has {tokens} tokens > max_tokens={self.max_tokens}: a pair is cut in the "
                               "data layer, at its answers' ends (SampleDataset(truncate_to=max_tokens)), never by "
                               "the batcher; or set over_cap to 'drop'")
        kept = self.long_cap
        if labels is not None:
            if len(labels) != tokens:
                raise ValueError(f"sample {uid}: {len(labels)} labels for {tokens} tokens")
            label_tokens = count_label_tokens(labels[:kept])
        elif label_tokens == 0 or label_tokens >= tokens - 1:  # no label, or every position: so is the prefix
            label_tokens = min(label_tokens, kept - 1)
        else:
            raise OverCapError(
                f"sample {uid} has {tokens} tokens > max_tokens={self.max_tokens} and {label_tokens} label "
                f"tokens: how many of them its first {kept} tokens hold is unknown, so the step's label count "
                "(the loss scale) would be wrong. Give the sample's labels with its sizes (the Feed's 4th "
                "element: (tokens, label_tokens, patches, labels)), or cut it in the data layer")
        tokens = kept
        return SampleCost(uid, tokens, label_tokens, patches, self.cost(tokens, patches)), "truncated"
