"""tools/bench/bench_memory.py at tiny sizes: its interface, and that its paths agree. The tool starts
one process per path (a fresh peak to measure), so these tests live with the launches."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5  # as tests/unit/test_loss.py


BENCH_MEMORY = ROOT / "tools" / "bench" / "bench_memory.py"


def test_bench_memory_tool_prints_one_json_object():
    """tools/bench/bench_memory.py at a tiny size: its interface, and both paths agree."""
    proc = subprocess.run([sys.executable, str(BENCH_MEMORY), "--vocab", "500", "--hidden", "32",
                           "--tokens", "300", "--chunk-tokens", "64", "--softcap", "30", "--json"],
                          capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"full_loss_peak_mb", "chunked_loss_peak_mb", "max_abs_grad_diff", "vocab", "hidden", "tokens",
            "chunk_tokens"} <= set(report)
    assert report["num_chunks"] == 5 and report["loss_rel_diff"] <= LOSS_RTOL
    assert report["max_rel_grad_diff"] <= GRAD_RTOL


def test_bench_memory_measures_activation_checkpointing():
    """tools/bench/bench_memory.py --checkpointing at a tiny size: checkpointing keeps less and the
    gradients are the plain run's."""
    proc = subprocess.run([sys.executable, str(BENCH_MEMORY), "--checkpointing", "--layers", "4",
                           "--hidden", "128", "--vocab", "500", "--tokens", "2048", "--json"],
                          capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["checkpointing_peak_mb"] < report["plain_peak_mb"] and report["max_rel_grad_diff"] <= GRAD_RTOL
