"""A preference run stopped mid-epoch and resumed trains what the uninterrupted run trains: 2
DeepSpeed ranks (ZeRO-2), the tiny model with LoRA, DPO against the adapter-disabled base model
(a reference forward per micro-batch, dummies too), the bundled pairs over 2 epochs, small
micro-batches so the steps are many. The resumed run's micro-batches (``--audit_ids``), step by
step, are the uninterrupted run's, every pair twice (once an epoch), and its per-step losses and
rewards agree with the uninterrupted run's to fp32 round-off: the optimizer state, the reference
(the base weights) and the batcher's state all came back."""

import json
import shutil
from collections import Counter

import pytest

from launch import ROOT, audit, deepspeed, odb_config


def step_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.mark.e2e
def test_a_resumed_dpo_run_trains_the_same_pairs_and_losses_as_one_uninterrupted(tmp_path):
    lora = tmp_path / "lora.json"
    lora.write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    common = ["--data", str(ROOT / "data" / "preference.jsonl"), "--objective", "dpo", "--lora", str(lora),
              "--odb_config", str(odb_config(tmp_path, max_tokens=1024, window=16, gas=2)), "--epochs", "2",
              "--audit_ids", "--num_workers", "1", "--log_steps", "1", "--lr", "5e-3"]
    full, part = tmp_path / "full", tmp_path / "part"
    deepspeed([*common, "--output_dir", str(full), "--no_final_checkpoint"])
    reference = audit(full, 2)
    steps = max(r["step"] for rows in reference for r in rows) + 1
    k = steps // 2 + 1  # (past the first epoch's end or near it: mid-run either way)
    deepspeed([*common, "--output_dir", str(part), "--max_steps", str(k)])
    first = audit(part, 2)
    for rank in range(2):
        shutil.move(part / f"emitted_ids.rank{rank}.jsonl", part / f"first.rank{rank}.jsonl")
    resumed = deepspeed([*common, "--output_dir", str(part), "--resume"])
    assert "resumed from" in resumed.stdout
    second = audit(part, 2)
    for rank in range(2):
        assert max(r["step"] for r in first[rank]) == k - 1
        assert first[rank] + second[rank] == reference[rank]  # the same micro-batches, step by step
    assert Counter(i for rows in first + second for r in rows for i in r["ids"]) == Counter(list(range(40)) * 2)
    whole, split = step_rows(full), step_rows(part)
    assert sorted(whole) == sorted(split) == list(range(steps)) and steps > k
    for step in range(steps):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies"):
            assert split[step][key] == pytest.approx(whole[step][key], rel=1e-4, abs=1e-5), (step, key)
    assert abs(whole[steps - 1]["loss"] - whole[0]["loss"]) > 1e-3  # it trained (the losses move)
