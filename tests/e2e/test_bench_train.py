"""tools/bench/bench_train.py keeps running: a small 2-rank comparison of padded batches, the paper's package
(in its own virtual environment, installed from the package index on first use) and odb, checked
from each run's own emitted-id audit and token counts, not from the tool's arithmetic alone."""

import json
import subprocess
import sys

import pytest
import torch

from launch import ROOT

SAMPLES = 36


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_bench_train_compares_systems_on_the_same_samples(tmp_path):
    trace = tmp_path / "trace.txt"  # a high-variance profile: lengths of 40 to 1800 tokens, run at a quarter
    trace.write_text("\n".join(str(40 + (i * 733) % 1760) for i in range(SAMPLES)) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "bench_train.py"), "--trace", str(trace),
                           "--samples", str(SAMPLES), "--length_scale", "4", "--max_tokens", "512",
                           "--systems", "fixed8,paper_pkg,odb",
                           "--world_size", "2", "--keep", str(tmp_path / "runs"), "--json"],
                          capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["samples"], result["world_size"]) == (SAMPLES, 2)
    systems = result["systems"]
    assert list(systems) == ["fixed8", "paper_pkg", "odb"]
    keys = {"samples_per_s", "real_tokens_per_s", "materialized_tokens_per_s", "padding_ratio", "steps",
            "micro_batches", "final_loss"}
    for name, row in systems.items():
        assert keys <= set(row), name
        assert row["coverage"] == {"once": SAMPLES, "never": 0, "more_than_once": 0}, name
        assert row["samples_per_s"] > 0 and row["final_loss"] > 0, name
    # every system trained the same tokens: the samples' own lengths
    samples = torch.load(tmp_path / "runs" / "samples.pt")
    real = sum(len(s["input_ids"]) for s in samples)
    for name in systems:
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["real_tokens"] == real, name
    assert systems["odb"]["padding_ratio"] == 0.0
    assert systems["fixed8"]["padding_ratio"] > 0.3  # batches of 8 over lengths 40-1800
    assert 0.0 < systems["paper_pkg"]["padding_ratio"] < systems["fixed8"]["padding_ratio"]  # sorted groups
    assert systems["fixed8"]["micro_batches"] == 2 * -(-SAMPLES // 2 // 8)  # each rank's half in batches of 8
    assert "online-dynamic-batching 0.1.2" in (tmp_path / "runs" / "paper_pkg" / "summary.json").read_text()
