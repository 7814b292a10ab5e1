"""A preference step's metrics row (odb.telemetry): the loss per pair and TRL's reward metrics, means
over the step's pairs on every rank, from each rank's report on the wire; figures worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, StepPlan
from odb.telemetry.reports import STEP_FIELDS, Step, StepReports, StepTimes
from odb.telemetry.rows import step_row


def plan(pairs: int) -> StepPlan:
    micro = MicroBatch(tuple(SampleCost(uid, 40, 10, 0, 40) for uid in range(pairs)))
    return StepPlan(epoch=0, step=0, micro_batches=(micro,), num_label_tokens=80, num_samples=pairs,
                    rank_costs=((120, 40),), rank_tokens=((120, 40),))


def row(rank_steps: list[Step]) -> dict:
    """The row rank 0 makes from every rank's report of one step, as the wire carries them."""
    reports = []
    for step in rank_steps:
        wire = StepReports(max_steps=1, dataset_size=0)
        wire.pending.append(step)
        reports.append(wire.fields({}, {}))
    per_rank = {name: np.array([report[name][0] for report in reports]) for name in STEP_FIELDS}
    return step_row(rank_steps[0], per_rank, samples_done=4, dataset_size=10, max_tokens=128, skipped={},
                    truncated={"samples": 0, "tokens": 0})


def test_a_preference_step_reports_its_loss_per_pair_and_the_rewards_over_every_rank():
    times = StepTimes(wait=0.0, plan=0.0, collective=0.0, step=1.0, ended=0.0)
    got = row([Step(plan(4), 2.0, 1e-3, times, rewards=(3.0, 1.0, 2)),  # rank 0: 3 pairs
               Step(plan(4), 1.0, 1e-3, times, rewards=(-1.0, 0.5, 0))])  # rank 1: 1 pair
    assert got["loss"] == pytest.approx(3.0 / 4)  # the pairs' summed loss over the step's 4 pairs
    assert got["rewards/chosen"] == pytest.approx(2.0 / 4) and got["rewards/rejected"] == pytest.approx(1.5 / 4)
    assert got["rewards/margins"] == pytest.approx(0.5 / 4) and got["rewards/accuracies"] == pytest.approx(2 / 4)


def test_a_next_token_step_has_no_rewards_and_its_loss_is_per_label_token():
    times = StepTimes(wait=0.0, plan=0.0, collective=0.0, step=1.0, ended=0.0)
    got = row([Step(plan(4), 2.0, 1e-3, times), Step(plan(4), 1.0, 1e-3, times)])
    assert got["loss"] == pytest.approx(3.0 / 80)
    assert not [key for key in got if key.startswith("rewards/")]
