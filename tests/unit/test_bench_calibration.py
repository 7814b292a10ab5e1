"""tools/bench/bench_calibration.py keeps running: a few samples of a trace with images, two simulated
ranks training each micro-batch for real under the fitted and the manual cost model."""

import json

from conftest import tool_module


def test_the_calibration_benchmark_reports_both_cost_models(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{40 + 37 * i} {64 * (i % 3)}\n" for i in range(10)))
    tool_module("bench_calibration").main(["--trace", str(trace), "--world_size", "2", "--samples", "10",
                                           "--max_tokens", "512", "--window", "4", "--epochs", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "tiny_vl_model.json" and out["samples"] == 10  # (patches: the tiny Qwen2-VL)
    for mode in ("fit", "manual"):
        row = out[mode]
        assert 0 < row["sync_efficiency"] <= 1 and 0 < row["law_sync_efficiency"] <= 1 and row["steps"] > 0
        assert row["coefficients"]["attn_coef"] >= 0 and "_micro" not in row
        assert 0 < row["last_epoch"]["steps"] < row["steps"] and 0 < row["last_epoch"]["law_sync_efficiency"] <= 1
    assert out["manual"]["coefficients"] == {"attn_coef": 0.0, "patch_coef": 0.0, "r2": None, "micro_batches": None}
    assert out["law"]["micro_batches"] >= 2 * 3  # every real micro-batch of both runs (3 a run at least)
