"""Telemetry: metrics.jsonl figures, W&B offline (one run per job), plots."""

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from conftest import bundled_tokenizer
from launch import ROOT, audit, deepspeed, ds_config, odb_config
from odb.data.processing import SampleDataset
from wandb_offline import read_wandb_history

TOKENIZER = bundled_tokenizer()


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb")
    out = tmp / "run"
    os.environ["WANDB_MODE"] = "offline"
    try:
        proc = deepspeed(["--deepspeed_config", str(ds_config(tmp, 2)),
                          "--odb_config", str(odb_config(tmp, max_tokens=512, window=16, gas=2, cost_model="fit")),
                          "--max_samples", "120", "--output_dir", str(out), "--audit_ids", "--no_final_checkpoint",
                          "--report_to", "wandb", "--run_name", "odb-test", "--wandb_tags", "ci,tiny"],
                         use_runner=True)  # DeepSpeed's own runner, as the README's first command
    finally:
        del os.environ["WANDB_MODE"]
    return out, proc


def test_one_offline_wandb_run_per_job_holding_what_metrics_jsonl_holds(wandb_run):
    out, proc = wandb_run
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 logs; not one run per rank
    history = read_wandb_history(next(runs[0].glob("*.wandb")))
    rows = metrics(out)
    assert len(history) == len(rows) > 3
    for logged, row in zip(history, rows):
        assert logged["_step"] == row["step"]
        for key, value in row.items():
            if not isinstance(value, dict):
                assert logged[key] == pytest.approx(value), key


def test_metrics_jsonl_matches_what_was_trained(wandb_run):
    out, proc = wandb_run
    rows, trained = metrics(out), audit(out, 2)
    dataset = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, truncate_to=512)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in rows] == list(range(summary["steps"]))
    for row in rows:
        micro = [m for rank in trained for m in rank if m["step"] == row["step"]]
        tokens = sum(len(dataset[i]["input_ids"]) for m in micro for i in m["ids"])
        assert row["real_tokens"] == tokens == row["materialized_tokens"] and row["padding_ratio"] == 0
        assert row["samples"] == sum(len(m["ids"]) for m in micro)
        assert row["micro_batches"] == sum(1 for m in micro if m["ids"])
        assert row["dummy_micro_batches"] == sum(1 for m in micro if not m["ids"])
        assert row["rank_tokens_max"] <= 2 * 512 and 0 < row["sync_efficiency"] <= 1
        assert 0 < row["planned_sync_efficiency"] <= 1
        assert row["loss"] > 0 and row["lr"] > 0
    assert rows[-1]["samples_done"] == 120 == summary["samples_emitted"]
    # telemetry and the cost fit rode on the rounds: the start check, one per round, one at the end
    assert summary["this_process"]["odb_collectives"] == summary["rounds"] + 2
    # (a run this short ends before 16 micro-batch times reach the fit: tests/e2e/test_faults.py has one that fits)
    fit = summary["cost_model"]
    assert fit["mode"] == "fit" and fit["attn_coef"] >= 0 and fit["patch_coef"] == 0, fit
    assert 0 < summary["this_process"]["sync_efficiency"] <= 1
    # the run's first and last losses are the global per-step losses, not rank 0's own
    losses = [r["loss"] for r in rows if r["label_tokens"]]
    assert summary["loss_first"] == pytest.approx(sum(losses[:3]) / 3, abs=1e-5)
    assert summary["loss_last"] == pytest.approx(sum(losses[-3:]) / 3, abs=1e-5)
    assert "attention odb_varlen: SDPA per group" in proc.stdout and "zero_stage 2" in proc.stdout


def test_padding_figures_of_fixed_batches_are_right(tmp_path):
    out = tmp_path / "fixed"
    deepspeed(["--deepspeed_config", str(ds_config(tmp_path, 0)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16, policy="fixed", batch_size=4,
                                              sharding="static")),
               "--max_samples", "40", "--output_dir", str(out), "--audit_ids", "--no_final_checkpoint"])
    dataset = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, truncate_to=512)
    trained = audit(out, 2)
    for row in metrics(out):
        micro = [m for rank in trained for m in rank if m["step"] == row["step"] and m["ids"]]
        lengths = [[len(dataset[i]["input_ids"]) for i in m["ids"]] for m in micro]
        real, padded = sum(map(sum, lengths)), sum(len(x) * max(x) for x in lengths)
        assert (row["real_tokens"], row["materialized_tokens"]) == (real, padded)
        assert row["padding_ratio"] == pytest.approx(1 - real / padded, abs=1e-6)


def test_plot_tool_draws_two_runs_into_one_png(wandb_run, tmp_path):
    import subprocess
    import sys

    out, _ = wandb_run
    png = tmp_path / "plot.png"
    subprocess.run([sys.executable, "-m", "odb.cli", "plot", str(out), str(out), "--labels", "a", "b",
                    "--out", str(png)], check=True, timeout=120)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 640)
        assert len(image.convert("RGB").getcolors(1 << 20)) > 10  # something was drawn
