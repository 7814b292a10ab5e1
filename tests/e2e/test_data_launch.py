"""Data in training runs for real (launch/train.py on 2 DeepSpeed ranks): a vision-language
model trained packed, and records skipped or stopped on (--strict) on every rank. The data
pipeline itself, in one process, is tests/unit/test_data.py's."""

import json
from collections import Counter

import pytest

from bad_records import BAD, bad_data
from launch import KILLED, ROOT, deepspeed, ds_config, odb_config

VL = ROOT / "configs" / "tiny_vl_model.json"


def test_tiny_qwen2_vl_trains_packed_at_zero3_and_its_loss_falls(tmp_path):
    out = tmp_path / "vl"
    deepspeed(["--model", str(VL), "--data", str(ROOT / "data" / "mm" / "train.jsonl"),
               "--deepspeed_config", str(ds_config(tmp_path, 3)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=256, window=16, gas=2, max_patches=1024)),
               "--max_samples", "24", "--epochs", "12", "--lr", "5e-3", "--warmup_ratio", "0",
               "--output_dir", str(out), "--no_final_checkpoint"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_emitted"] == 24 * 12 and summary["padding_ratio"] == 0
    assert summary["loss_last"] < 0.7 * summary["loss_first"] and summary["loss_last"] == summary["loss_last"]


def test_bad_records_in_a_training_run_are_counted_in_the_summary_and_strict_stops_every_rank(tmp_path):
    data = bad_data(tmp_path)
    common = ["--model", str(VL), "--data", str(data), "--deepspeed_config", str(ds_config(tmp_path, 2)),
              "--odb_config", str(odb_config(tmp_path, max_tokens=64, window=4)), "--no_final_checkpoint"]
    deepspeed(common + ["--output_dir", str(tmp_path / "skip")])
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["skipped"] == dict(Counter(reason for _, reason in BAD))
    assert summary["samples_emitted"] == 2
    with pytest.raises(AssertionError, match=r"DataError: \S+bad\.jsonl:\d+: \w+.*without --strict") as failed:
        deepspeed(common + ["--output_dir", str(tmp_path / "strict"), "--strict"], timeout=180)
    assert KILLED not in str(failed.value)  # no hang: every rank ended by itself
