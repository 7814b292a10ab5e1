"""Models too big for one rank: built partitioned at ZeRO-3, in the training precision, with
activation checkpointing.

The oracle of a partitioned build is the same model built whole in one process (a seed's random
init, a saved folder); the oracle of activation checkpointing is the same step without it. The
2-rank checks run in tests/e2e/big_models_worker.py; tools/bench/bench_load.py measures the memory.
What needs no launch (the precision, the flag, checkpointed gradients): tests/unit/test_checkpointing.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, deepspeed

WORKER = Path(__file__).resolve().parent / "big_models_worker.py"


def launch(script: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return deepspeed(list(args), timeout=timeout, script=script)


def test_zero3_builds_partitioned_the_model_one_process_builds_whole(tmp_path):
    """2 ranks: random init (text, LoRA, Qwen2-VL) and saved folders, each gathered tensor equal to
    the whole build; bf16 / fp16 configs build in their precision; one SGD step with activation
    checkpointing (every layer and vision block recomputed) equals the step without it."""
    launch(WORKER, str(tmp_path))
    ranks = json.loads((tmp_path / "report.json").read_text())
    print("partitioned build:", {k: v for k, v in ranks[0].items() if "diff" in k})
    for report in ranks:
        for name in ("text", "text_lora", "vl"):
            assert report[f"{name}_partitioned"] and report[f"{name}_max_diff"] == 0.0, name
            assert report[f"{name}_same_random_stream"] and not report[f"{name}_zero3_flag_left_on"], name
            assert report[f"checkpointing_{name}_max_rel_diff"] <= 1e-5, name
            assert report[f"checkpointing_{name}_unmoved_max_diff"] == 0.0, name
            calls = report[f"checkpointing_{name}_calls"]
            assert set(calls["plain"].values()) == {1} and set(calls["checkpointed"].values()) == {2}, calls
        assert "vision_block" in report["checkpointing_vl_calls"]["checkpointed"]
        assert report["checkpointing_text_tensors_moved"] == 38  # every tensor
        assert report["checkpointing_text_lora_tensors_moved"] == 28  # each lora_B (lora_A: gradient 0 while B = 0)
        for name in ("folder", "vl_folder"):
            assert report[f"{name}_partitioned"] and report[f"{name}_max_diff"] == 0.0, name
        assert report["bf16_zero3_dtypes"] == ["torch.bfloat16"] and report["bf16_zero3_partitioned"]
        assert report["fp16_zero3_dtypes"] == ["torch.float16"] and report["fp16_zero3_partitioned"]
        assert report["bf16_zero2_dtypes"] == ["torch.bfloat16"] and not report["bf16_zero2_partitioned"]


def test_bench_load_reports_the_partitioned_share(tmp_path):
    """tools/bench/bench_load.py on a small model: the rank holds half the parameters after a partitioned
    build, all of them after a whole one, half after deepspeed.initialize either way."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "bench_load.py"), "--layers", "2",
                           "--hidden", "256",
                           "--intermediate", "688", "--vocab", "1024", "--heads", "4"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    whole = result["model_mb"]
    assert result["params"] == 2 * 1024 * 256 + 2 * (4 * 256 * 256 + 3 * 256 * 688 + 2 * 256) + 256
    assert result["full_load_param_mb_held_after_build_per_rank"] == [whole, whole]
    half = pytest.approx([whole / 2] * 2, abs=0.1)
    assert result["partitioned_param_mb_held_after_build_per_rank"] == half
    assert result["full_load_param_mb_held_per_rank"] == result["partitioned_param_mb_held_per_rank"] == half
    assert len(result["full_load_peak_rss_mb_per_rank"]) == len(result["partitioned_peak_rss_mb_per_rank"]) == 2
