"""A preference objective on a mixture-of-experts model with activation checkpointing at ZeRO-3,
two CPU ranks, a dummy on one (tests/e2e/preference_moe_worker.py): the step no longer hangs, and
it equals one process, each pair alone with TRL's loss (to 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import deepspeed

WORKER = Path(__file__).resolve().parent / "preference_moe_worker.py"


@pytest.mark.e2e
def test_a_moe_preference_step_with_a_dummy_runs_and_equals_one_process_at_zero3(tmp_path):
    deepspeed([str(tmp_path)], timeout=240, script=WORKER)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert abs(got["loss_sum"] - got["oracle"]) <= 1e-5 * abs(got["oracle"]) + 1e-6, (rank, got)
        assert got["grads"]["rel"] <= 1e-5, (rank, got["grads"])
