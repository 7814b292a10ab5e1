"""--global_batch_tokens through launch/train.py: gas derived at start for 2 ranks, and again at a
resume on 4 (ZeRO-2, the tiny model, the bundled data). The oracle is the run's own audit and
plans: every record trains exactly once across the change, each run's steps hold the derived gas,
and summary.json's tokens per step are what the steps carried, near the tokens wanted."""

from __future__ import annotations

import json
from collections import Counter

import torch

from launch import ROOT, audit, deepspeed, ds_config, odb_config


def test_a_resume_on_four_ranks_derives_gas_again_and_keeps_the_tokens_per_step(tmp_path):
    out = tmp_path / "run"
    config = odb_config(tmp_path, max_tokens=256, window=16, lookahead=4, global_batch_tokens=2048)
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--data", str(ROOT / "data" / "chat.jsonl"),
              "--max_samples", "200", "--output_dir", str(out), "--audit_ids", "--num_workers", "1",
              "--odb_config", str(config), "--log_steps", "1"]
    first = deepspeed([*common, "--max_steps", "4", "--save_steps", "4", "--no_final_checkpoint"], nproc=2,
                      timeout=600)
    assert "global_batch_tokens 2048: gas 4 on 2 rank(s) of up to 256 tokens" in first.stdout
    saved = json.loads((out / "checkpoints" / "step4" / "run_config.json").read_text())
    assert saved["batching"]["gas"] == 4  # the derived gas where the configured one (1) was
    assert (saved["optimization"]["deepspeed"]["gradient_accumulation_steps"],
            saved["optimization"]["deepspeed"]["train_batch_size"]) == (4, 8)
    before = audit(out, 2)
    for r in range(2):
        (out / f"emitted_ids.rank{r}.jsonl").rename(out / f"first.rank{r}.jsonl")
    resumed = deepspeed([*common, "--resume"], nproc=4, timeout=600)
    assert "global_batch_tokens 2048: gas 2 on 4 rank(s) of up to 256 tokens" in resumed.stdout
    after = audit(out, 4)
    assert {r["micro"] for rank in before for r in rank} == {0, 1, 2, 3}
    assert {r["micro"] for rank in after for r in rank} == {0, 1}
    trained = Counter(i for rank in before + after for row in rank for i in row["ids"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["batching"]["gas"] == 2
    assert (summary["config"]["optimization"]["deepspeed"]["gradient_accumulation_steps"],
            summary["config"]["optimization"]["deepspeed"]["train_batch_size"]) == (2, 8)
    [states] = (out / "checkpoints").glob(f"step{summary['steps']}/**/mp_rank_00_model_states.pt")
    engine = torch.load(states, map_location="cpu", weights_only=False)  # DeepSpeed's engine's own
    assert (engine["ds_config"]["gradient_accumulation_steps"], engine["ds_config"]["train_batch_size"]) == (2, 8)
    assert sum(trained.values()) + sum(summary["skipped"].values()) == 200 and set(trained.values()) == {1}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = summary["tokens_per_step"]
    print(f"tokens per step: {per_step} (wanted 2048); steps {summary['steps']}")
    assert abs(per_step["mean"] - 2048) <= 0.1 * 2048 and per_step["min"] <= per_step["mean"] <= per_step["max"]
    assert len([r for r in rows if "loss" in r]) == summary["steps"]
