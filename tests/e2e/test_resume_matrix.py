"""A run stopped part-way (``--max_steps``) and resumed (``--resume``) through launch/train.py
trains what the same run trains uninterrupted, under the settings the other resume tests leave out:
ZeRO-0 in bf16, ZeRO-1 with LoRA, evaluation and W&B, FSDP2 with LoRA, and a vision-language
model. The oracle is the uninterrupted run: the same micro-batches on every rank (the audit ids),
each step's loss and learning rate, the evaluations, the summary's counts, and (W&B) the rows the
two offline runs of the interrupted job logged between them."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from launch import ROOT, audit, deepspeed, ds_config, fsdp2, odb_config
from wandb_offline import offline_histories

STOP = 2  # steps the first part trains (a multiple of --eval_steps: no extra evaluation at its end)
VL = ROOT / "configs" / "tiny_vl_model.json"
CASES = {
    "zero0-bf16": {"stage": 0, "ds": {"bf16": {"enabled": True}}, "flags": []},
    "zero1-lora-eval-wandb": {"stage": 1, "flags": ["--lora", "--val_ratio", "0.1", "--eval_steps", "2",
                                                    "--report_to", "wandb"]},
    "fsdp2-lora": {"backend": "fsdp2", "flags": ["--lora"]},
    "zero2-vision": {"stage": 2, "flags": ["--model", str(VL), "--data", str(ROOT / "data" / "mm" / "train.jsonl")],
                     "odb": {"max_patches": 1024}},
}
COUNTS = ("steps", "micro_batches", "dummy_micro_batches", "samples_emitted", "real_tokens", "materialized_tokens",
          "label_tokens", "rounds", "dropped", "skipped", "eval_loss")


def rows(out: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's training rows and evaluation rows."""
    every = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in every if "loss" in r], [r for r in every if "eval_loss" in r]


def launch(case: dict, tmp: Path, out: Path, *extra: str) -> None:
    odb = odb_config(tmp, max_tokens=256, window=16, gas=2, **case.get("odb", {}))
    flags = ["--odb_config", str(odb), "--max_samples", "48", "--audit_ids", "--output_dir", str(out),
             "--no_final_checkpoint", *case["flags"], *extra]
    if case.get("backend") == "fsdp2":
        fsdp2(["--backend", "fsdp2", *flags])
    else:
        deepspeed(["--deepspeed_config", str(ds_config(tmp, case["stage"], **case.get("ds", {}))), *flags])


@pytest.mark.parametrize("name", list(CASES))
def test_a_stopped_and_resumed_run_trains_what_the_uninterrupted_run_trains(name, tmp_path, monkeypatch):
    case = CASES[name]
    monkeypatch.setenv("WANDB_MODE", "offline")
    full, part = tmp_path / "full", tmp_path / "part"
    launch(case, tmp_path, full)
    launch(case, tmp_path, part, "--max_steps", str(STOP), "--save_steps", str(STOP))
    first = audit(part, 2)
    for rank in range(2):
        os.replace(part / f"emitted_ids.rank{rank}.jsonl", part / f"first.rank{rank}.jsonl")
    launch(case, tmp_path, part, "--resume")

    whole, second = audit(full, 2), audit(part, 2)
    for rank in range(2):
        assert max(r["step"] for r in first[rank]) == STOP - 1
        assert first[rank] + second[rank] == whole[rank], f"rank {rank} trained other micro-batches"
    assert Counter(i for ranks in first + second for r in ranks for i in r["ids"]) == \
        Counter(i for ranks in whole for r in ranks for i in r["ids"])

    (steps, evals), (resumed_steps, resumed_evals) = rows(full), rows(part)
    assert len(steps) > STOP + 1, "the run is too short to stop part-way"
    assert [r["step"] for r in resumed_steps] == [r["step"] for r in steps]
    for mine, theirs in zip(resumed_steps, steps, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-9), mine["step"]
        assert mine["label_tokens"] == theirs["label_tokens"] and mine["samples_done"] == theirs["samples_done"]
    assert [r["step"] for r in resumed_evals] == [r["step"] for r in evals]
    for mine, theirs in zip(resumed_evals, evals, strict=True):
        assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5), mine["step"]
        assert mine["eval_label_tokens"] == theirs["eval_label_tokens"]

    summary, resumed = (json.loads((o / "summary.json").read_text()) for o in (full, part))
    for key in COUNTS:
        assert resumed[key] == (summary[key] if summary[key] is None else pytest.approx(summary[key], rel=1e-5)), key
    assert resumed["loss_first"] == pytest.approx(summary["loss_first"], rel=1e-4)
    assert resumed["this_process"]["steps"] == summary["steps"] - STOP

    if "wandb" in case["flags"]:
        (logged,), (before, after) = offline_histories(full), offline_histories(part)
        assert [r["step"] for r in before + after] == [r["step"] for r in logged]
        assert max(r["step"] for r in before) < min(r["step"] for r in after)
        for mine, theirs in zip(before + after, logged, strict=True):
            for key in ("loss", "eval_loss"):
                if key in theirs:
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6)
