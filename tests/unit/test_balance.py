"""The sync efficiency a metrics row and the summary report: measured from every rank's forward +
forward time of the step (its report), and apart as the cost model planned it."""

import numpy as np
import pytest

from conftest import one_step_plan
from odb.telemetry import StepTimes, Telemetry


def test_measured_and_planned_sync_efficiency(tmp_path):
    # one micro-batch position: the plan priced rank 0's at 10 and rank 1's at 40; they took 0.3 s and 0.1 s
    plan = one_step_plan([[]])._replace(rank_costs=((10, 40),), rank_tokens=((10, 40),))
    ranks = [Telemetry(rank=r, max_steps_per_round=2, max_tokens=64, dataset_size=1, output_dir=tmp_path)
             for r in range(2)]
    reports = []
    for telemetry, compute in zip(ranks, (0.3, 0.1), strict=True):
        telemetry.record(plan, loss_sum=0.0, lr=0.0,
                         times=StepTimes(wait=0.0, plan=0.0, collective=0.0, step=0.5, ended=0.0, forward=compute))
        reports.append(telemetry.report({}))
    row, = ranks[0].on_reports(np.stack(reports))
    assert row["sync_efficiency"] == pytest.approx((0.3 + 0.1) / 2 / 0.3, abs=1e-6)
    assert row["planned_sync_efficiency"] == pytest.approx((10 + 40) / 2 / 40, abs=1e-6)
    assert row["forward_s"] == pytest.approx(0.3, abs=1e-6)  # the slowest rank's
    totals = {"steps": 1, "samples": 0, "micro_batches": 2, "dummy_micro_batches": 0, "real_tokens": 50,
              "materialized_tokens": 50, "label_tokens": 0, "wall_us": 1, "dropped": 0}
    summary = ranks[0].summary(totals, world_size=2, epochs=1, rounds=1, collectives=2, policy="odb")
    assert summary["this_process"]["sync_efficiency"] == row["sync_efficiency"]
    assert summary["this_process"]["planned_sync_efficiency"] == row["planned_sync_efficiency"]
    for telemetry in ranks:
        telemetry.close()
