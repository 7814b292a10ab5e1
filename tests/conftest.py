"""Shared helpers: invariant checks over simulated ranks."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from odb.batching.plan import StepPlan  # noqa: E402


def check_aligned(steps: list[list[StepPlan]]) -> None:
    """I1: every rank has the same steps and the same micro-batches per step."""
    shapes = [[(s.epoch, s.step, len(s.micro_batches)) for s in rank_steps] for rank_steps in steps]
    assert all(shape == shapes[0] for shape in shapes), "ranks are not aligned"


def check_exact_once(steps: list[list[StepPlan]], expected: Counter) -> None:
    """I2: the uids trained are exactly ``expected`` (no duplicates, nothing missing)."""
    trained = Counter(u for rank_steps in steps for s in rank_steps for m in s.micro_batches for u in m.uids)
    assert trained == expected, (f"missing {sorted((expected - trained).elements())[:10]}, "
                                 f"extra {sorted((trained - expected).elements())[:10]}")


def check_label_tokens(steps: list[list[StepPlan]]) -> None:
    """I4: every rank's N_step equals the label tokens of that step over all ranks (and the step's
    sample count its samples over all ranks)."""
    for position in range(len(steps[0])):
        actual = sum(m.label_tokens for rank_steps in steps for m in rank_steps[position].micro_batches)
        samples = sum(len(m.samples) for rank_steps in steps for m in rank_steps[position].micro_batches)
        for rank_steps in steps:
            assert rank_steps[position].num_label_tokens == actual
            assert rank_steps[position].num_samples == samples


def check_caps(steps: list[list[StepPlan]], max_tokens: int, max_patches: int | None = None) -> None:
    """I5: no packed micro-batch over the caps."""
    for rank_steps in steps:
        for s in rank_steps:
            for m in s.micro_batches:
                assert m.tokens <= max_tokens
                if max_patches is not None:
                    assert sum(x.patches for x in m.samples) <= max_patches


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))
