"""The report wire: what a rank tells the others about its steps, riding on the next round.

A rank's report (:func:`report_layout`) is an int64 vector (sent cut to the steps it holds,
:meth:`odb.batching.wire.Layout.pack`): the steps it trained since
the last round (``num_steps`` from ``first_step``, each a slot of every per-step array) and its
whole-run record counts (``skipped`` by reason, in :data:`odb.data.formats.SKIP_REASONS` order,
``fetched``, ``lost``, ``truncated_samples``, ``truncated_tokens``). Loss sums are in millionths,
times in microseconds; ``aux_sum_micro`` is a mixture-of-experts model's router loss times real
tokens summed over the rank's micro-batches (-1: no router loss); ``epoch`` is the latest epoch of
the rank's samples in the step (``uid // dataset_size``), or -1 for dummies only; ``attn_area`` is
the sum of its sequences' squared lengths (a pair's two apart; the attention term of the model
FLOPs); ``forward_us`` the time of its micro-batches' forward passes (the measured sync
efficiency); a preference objective's summed rewards of the chosen and the rejected answers
(millionths) and its pairs whose chosen reward is the higher (``ranked_right``; -1: next-token
loss, no pairs). The final gather appends the rank's run totals (:data:`TOTALS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from odb.batching.plan import StepPlan
from odb.batching.wire import Layout
from odb.data.formats import SKIP_REASONS

__all__ = ["COUNTS", "RECORDS", "STEP_FIELDS", "TOTALS", "Step", "StepReports", "StepTimes", "report_layout"]

STEP_FIELDS = ("loss_sum_micro", "materialized", "wait_us", "plan_us", "collective_us", "epoch", "aux_sum_micro",
               "attn_area", "forward_us", "chosen_reward_micro", "rejected_reward_micro", "ranked_right")
COUNTS = ("micro_batches", "dummy_micro_batches", "samples", "real_tokens", "materialized_tokens",
          "label_tokens", "steps", "wall_us", "long_samples")
TOTALS = Layout(scalars=COUNTS + ("dropped",))
"""A rank's run totals in the final gather: its whole-run counts, and its batcher's dropped samples."""
RECORDS = ("fetched", "lost", "truncated_samples", "truncated_tokens")


def report_layout(max_steps: int) -> Layout:
    """A rank's report for one round, room for ``max_steps`` steps (the module's docstring)."""
    return Layout(scalars=("num_steps", "first_step", *RECORDS),
                  arrays={"skipped": len(SKIP_REASONS), **dict.fromkeys(STEP_FIELDS, max_steps)},
                  lengths=dict.fromkeys(STEP_FIELDS, "num_steps"))  # (on the wire: the steps it has)


@dataclass
class StepTimes:
    """A rank's own seconds for one step."""

    wait: float  # waiting for processed samples
    plan: float  # odb: packing, decisions, dealing
    collective: float  # inside odb's round collective
    step: float  # wall time of the whole step
    ended: float  # time.time() at its end
    forward: float = 0.0  # the forward passes of its micro-batches (odb.training.step.clock.ForwardClock)


@dataclass
class Step:
    """A step this rank trained, until its report is gathered."""

    plan: StepPlan
    loss_sum: float
    lr: float
    times: StepTimes
    aux_sum: float | None = None  # MoE: sum over micro-batches of router loss x real tokens
    rewards: tuple[float, float, int] | None = None  # preference: chosen, rejected reward sums; pairs ranked right


class StepReports:
    """This rank's steps on their way: trained (``pending``), then reported (``reported``) until the
    round that carries them is gathered.

    Args:
        max_steps: the most steps a round can plan.
        dataset_size: for each step's epoch (0: the plan's, as for a weighted mixture, whose
            uids count their source's passes).
    """

    def __init__(self, *, max_steps: int, dataset_size: int) -> None:
        self.max_steps, self.dataset_size = max_steps, dataset_size
        self.layout = report_layout(max_steps)
        self.pending: list[Step] = []  # trained, not yet reported
        self.reported: list[Step] = []  # reported, not yet gathered

    def fields(self, skipped: Mapping[str, int], records: Mapping[str, int]) -> dict[str, Any]:
        """The report's fields (``skipped``: this rank's whole-run skipped records by reason;
        ``records``: its :data:`RECORDS`); the pending steps become the reported ones."""
        assert len(self.pending) <= self.max_steps, "more steps between rounds than a round plans"
        steps, size = self.pending, max(1, self.dataset_size)
        self.reported, self.pending = self.pending, []
        return {
            "num_steps": len(steps), "first_step": steps[0].plan.step if steps else -1,
            **{name: records.get(name, 0) for name in RECORDS},
            "skipped": [skipped.get(r, 0) for r in SKIP_REASONS],
            "loss_sum_micro": [round(s.loss_sum * 1e6) for s in steps],
            "materialized": [sum(m.materialized for m in s.plan.micro_batches) for s in steps],
            "wait_us": [round(s.times.wait * 1e6) for s in steps],
            "plan_us": [round(s.times.plan * 1e6) for s in steps],
            "collective_us": [round(s.times.collective * 1e6) for s in steps],
            "epoch": [max((u // size for m in s.plan.micro_batches for u in m.uids), default=-1)
                      if self.dataset_size else s.plan.epoch for s in steps],
            "aux_sum_micro": [-1 if s.aux_sum is None else round(s.aux_sum * 1e6) for s in steps],
            "attn_area": [sum(c.area for m in s.plan.micro_batches for c in m.samples) for s in steps],
            "forward_us": [round(s.times.forward * 1e6) for s in steps],
            "chosen_reward_micro": [0 if s.rewards is None else round(s.rewards[0] * 1e6) for s in steps],
            "rejected_reward_micro": [0 if s.rewards is None else round(s.rewards[1] * 1e6) for s in steps],
            "ranked_right": [-1 if s.rewards is None else int(s.rewards[2]) for s in steps]}

    def covers(self, fields: Mapping[str, np.ndarray]) -> bool:
        """Whether gathered ``fields`` report exactly this rank's reported steps, on every rank."""
        first = self.reported[0].plan.step if self.reported else -1
        return bool((fields["num_steps"] == len(self.reported)).all() and (fields["first_step"] == first).all())

    def take_reported(self) -> list[Step]:
        """The reported steps, now gathered: handed over and forgotten."""
        reported, self.reported = self.reported, []
        return reported
