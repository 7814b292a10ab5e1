"""tools/check/soak_alignment.py at a small size: its interface, and every requested sample planned."""

import json

import pytest

from conftest import tool_module

REPORT_KEYS = {"samples", "samples_done", "samples_trained", "ranks", "mode", "epochs", "dataset_size", "trace",
               "max_tokens", "window", "gas", "seed", "tracemalloc", "wall_s", "us_per_sample_wall",
               "us_per_sample_plan", "rounds", "aligned", "truncated", "dropped", "exact_once", "intervals",
               "summary"}
INTERVAL_KEYS = {"samples", "epochs", "rounds", "plan_us", "fetch_us", "wall_us", "cpu_us", "rss_mb", "traced_mb",
                 "traced_peak_mb", "gc_objects", "queue_steps", "window_samples", "bins", "stream_pending",
                 "feed_queue", "feed_forgotten"}


def soak_tool():
    return tool_module("soak_alignment")


def run_main(capsys, *args: str) -> dict:
    soak_tool().main([*args, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_soak_tool_plans_every_sample_and_reports_the_documented_keys(capsys):
    report = run_main(capsys, "--samples", "5000", "--dataset_size", "1000", "--interval", "1000",
                      "--window", "64", "--max_tokens", "4096", "--gas", "2", "--tracemalloc")
    assert set(report) == REPORT_KEYS
    assert report["samples_done"] == report["samples_trained"] == 5000 and report["epochs"] == 5
    assert report["aligned"] and report["exact_once"]
    assert [r["samples"] for r in report["intervals"]] == [1000, 2000, 3000, 4000, 5000]
    assert all(set(r) == INTERVAL_KEYS for r in report["intervals"])
    assert all(r["traced_mb"] is not None for r in report["intervals"])
    assert all(r["window_samples"] <= 64 + 64 for r in report["intervals"])  # window + lookahead
    summary = report["summary"]
    assert summary["verdict"] in ("flat", "growing") and isinstance(summary["problems"], list)
    assert {"first", "last", "rss_mb_per_1m_samples", "plan_us_per_1m_samples", "tolerances"} <= set(summary)


def test_soak_tool_quota_mode_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{(i * 7919) % 3000 + 20} {(i * 31) % 5}\n" for i in range(700)))
    report = run_main(capsys, "--samples", "4321", "--mode", "quota", "--trace", str(trace), "--ranks", "3",
                      "--interval", "2000", "--window", "32", "--out", str(tmp_path / "soak.png"))
    assert report["samples_done"] == report["samples_trained"] == 4321 and report["aligned"]
    assert report["intervals"][-1]["samples"] == 4321
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_soak_tool_refuses_a_join_run_of_partial_epochs():
    with pytest.raises(SystemExit):
        soak_tool().parse_args(["--samples", "5000", "--dataset_size", "3000"])
