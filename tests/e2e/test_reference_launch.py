"""``--reference precompute`` through launch/train.py on 2 DeepSpeed ranks (ZeRO-2, the tiny
model): a full-fine-tune DPO run makes its reference table before the first step, that step's loss
is log 2 (the policy is its reference: every pair's loss is -log sigmoid(0)), and a resume loads
the table instead of making it again."""

import json
import math

import numpy as np
import pytest

from launch import ROOT, deepspeed

MADE = "odb: reference log-probs (--reference precompute): "


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_a_dpo_run_makes_its_reference_once_and_starts_at_log_2(tmp_path):
    out = tmp_path / "out"
    args = ["--data", str(ROOT / "data" / "preference.jsonl"), "--objective", "dpo", "--output_dir", str(out),
            "--num_workers", "0", "--val_ratio", "0.1",  # (4 pairs held out: a table of their own)
            "--lr", "1e-9"]  # (the policy stays its reference: the eval loss too is log 2)
    first = deepspeed([*args, "--max_steps", "2"])
    made, made_eval = [line for line in first.stdout.splitlines() if line.startswith(MADE)]
    assert "from the initial weights" in made and str(out / "reference_logps.npy") in made
    assert "4 pairs of 4 records" in made_eval and str(out / "reference_logps.eval.npy") in made_eval
    table = np.load(out / "reference_logps.npy")
    meta = json.loads((out / "reference_logps.json").read_text())
    scored = int(np.isfinite(table).all(axis=1).sum())
    assert table.shape == (36, 2) and meta["pairs"] == scored and f"{scored} pairs of 36" in made
    assert (table[np.isfinite(table)] < 0).all()
    step0 = next(r for r in rows(out) if r.get("step") == 0 and "loss" in r)
    assert step0["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(step0["rewards/margins"]) < 1e-4
    (evaluated,) = [r for r in rows(out) if "eval_loss" in r]  # (the validation pairs against their own table)
    assert evaluated["eval_loss"] == pytest.approx(math.log(2), abs=1e-5)

    second = deepspeed([*args, "--max_steps", "4", "--resume", "auto"])
    assert not any(line.startswith(MADE) and "from the initial weights" in line for line in second.stdout.splitlines())
    assert f"loaded {out / 'reference_logps.npy'} ({scored} pairs" in second.stdout
    assert f"loaded {out / 'reference_logps.eval.npy'} (4 pairs" in second.stdout
    assert np.load(out / "reference_logps.npy").tobytes() == table.tobytes()
    assert "resumed from" in second.stdout and max(r["step"] for r in rows(out) if "loss" in r) > 1  # trained on
