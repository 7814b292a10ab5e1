"""The run's edges: LoRA on a vision model, the LR plan with lost records, resuming a finished
run, whole-run summaries, global losses, and quota-mode epochs. Each one a bug a review found."""

import json
import math
from collections import Counter

from conftest import bundled_tokenizer
from launch import ROOT, audit, deepspeed, ds_config, odb_config
from odb.training.model import build_model
from odb.training.mrope import supports_packing

TOKENIZER = bundled_tokenizer()
VL = ROOT / "configs" / "tiny_vl_model.json"
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out):
    return json.loads((out / "summary.json").read_text())


def chats(tmp_path, num_chats, num_without_answer=0):
    """The first ``num_chats`` bundled chats, then records with no assistant turn (skipped)."""
    lines = (ROOT / "data" / "chat.jsonl").read_text().splitlines()[:num_chats]
    lines += [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})
              for i in range(num_without_answer)]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_lora_on_a_vision_model_still_packs():
    """PEFT wraps the model: the check must look inside (it saw no rotary index and fell back to
    padded micro-batches over the cap)."""
    assert supports_packing(build_model(VL, seed=0, vocab_size=len(TOKENIZER)))
    assert supports_packing(build_model(VL, seed=0, vocab_size=len(TOKENIZER), lora=LORA))


def test_the_learning_rate_decays_over_what_trains_when_records_are_skipped(tmp_path):
    """60 chats + 20 records without an answer: the schedule plans 60 samples, not 80, so the
    last step's LR is the cosine at (samples before it) / 60, near the 0.1 x floor."""
    out, lr = tmp_path / "out", 1e-3
    deepspeed(["--data", str(chats(tmp_path, 60, 20)), "--deepspeed_config", str(ds_config(tmp_path, 2)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)), "--lr", str(lr),
               "--warmup_ratio", "0", "--output_dir", str(out), "--no_final_checkpoint"])
    rows, trained = metrics(out), summary(out)["samples_emitted"]
    assert trained == 60 and summary(out)["skipped"] == {"no_assistant_turn": 20}
    last = rows[-1]
    progress = (last["samples_done"] - last["samples"]) / trained
    expected = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert abs(last["lr"] - expected) <= 1e-9 * lr, (last["lr"], expected)


def test_resume_with_more_epochs_extends_a_finished_run_and_without_them_refuses(tmp_path):
    out = tmp_path / "out"
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "40", "--audit_ids",
              "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)), "--output_dir", str(out)]
    deepspeed(common)
    first = summary(out)
    (out / "emitted_ids.rank0.jsonl").rename(out / "first.rank0.jsonl")
    (out / "emitted_ids.rank1.jsonl").rename(out / "first.rank1.jsonl")
    deepspeed(common + ["--resume", "--epochs", "2"])
    rows = [r for rank in audit(out, 2) for r in rank]
    assert {r["epoch"] for r in rows} == {1}
    assert Counter(i for r in rows for i in r["ids"]) == Counter(range(40))  # epoch 1, exactly once
    second = summary(out)
    assert second["samples_emitted"] == 80 and second["steps"] > first["steps"] > 0
    try:
        deepspeed(common + ["--resume", "--epochs", "2"], timeout=180)
    except AssertionError as err:
        assert "already trained all 2 epoch(s); pass --epochs > 2" in str(err)
    else:
        raise AssertionError("a resume of a finished run with no more epochs must fail, not train 0 steps")
    assert summary(out) == second  # and it leaves the summary alone


def test_quota_mode_labels_each_sample_with_its_own_epoch(tmp_path):
    """40 samples, quota 60: the stream runs into a second pass over the data."""
    out = tmp_path / "out"
    deepspeed(["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "40", "--audit_ids",
               "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=8, mode="quota", quota=60)),
               "--output_dir", str(out), "--no_final_checkpoint"])
    rows = [r for rank in audit(out, 2) for r in rank]
    labels = [(i, e) for r in rows for i, e in zip(r["ids"], r.get("epochs", [r["epoch"]] * len(r["ids"])))]
    assert len(labels) == 60 and max(Counter(labels).values()) == 1  # no sample twice in one epoch
    assert {i for i, _ in labels} <= set(range(40)) and max(e for _, e in labels) >= 1
    steps = metrics(out)
    assert max(s["epoch"] for s in steps) >= 1
    assert summary(out)["epochs"] == 1.5

