"""``--objective reward`` through launch/train.py on 2 DeepSpeed ranks (ZeRO-2, the tiny model,
the bundled pairs), LoRA: the run trains, evaluates and saves a Hugging Face model. The saved
folder loads with ``AutoModelForSequenceClassification`` and, through TRL's RewardTrainer loss on
each evaluation pair alone (tests/preference_oracle.py), reproduces the run's final eval loss and
rewards: the export, the evaluation and the packed scores agree with the family's own class."""

import json

import pytest
import torch

from launch import ROOT, deepspeed


@pytest.mark.e2e
def test_a_reward_model_run_exports_a_classifier_that_scores_its_eval_pairs_as_the_run_did(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from conftest import bundled_tokenizer
    from odb.data.processing import SampleDataset
    from preference_oracle import trl_reward_loss

    out, data = tmp_path / "out", ROOT / "data" / "preference.jsonl"
    lora = tmp_path / "lora.json"
    lora.write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    deepspeed(["--data", str(data), "--objective", "reward", "--lora", str(lora), "--output_dir", str(out),
               "--num_workers", "0", "--max_steps", "3", "--eval_data", str(data), "--save_hf", "--lr", "1e-2"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval_loss" in r][-1]
    assert final["step"] == max(r["step"] for r in rows if "loss" in r) and final["eval_samples"] == 40
    model = AutoModelForSequenceClassification.from_pretrained(str(out / "hf")).eval()
    assert model.config.num_labels == 1
    pairs = SampleDataset(data, bundled_tokenizer(), pairs=True, cache_dir=tmp_path)
    with torch.no_grad():
        losses, rewards = zip(*(trl_reward_loss(model, pairs[i], pad_token_id=model.config.pad_token_id)
                                for i in range(len(pairs))))
    rewards = torch.stack(rewards)
    assert final["eval_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-4)
    assert final["eval_rewards/chosen"] == pytest.approx(float(rewards[:, 0].mean()), rel=1e-4, abs=1e-4)
    assert final["eval_rewards/accuracies"] == pytest.approx(float((rewards[:, 0] > rewards[:, 1]).double().mean()))
    assert abs(final["eval_loss"] - 0.6931) > 1e-3  # the scores differ
