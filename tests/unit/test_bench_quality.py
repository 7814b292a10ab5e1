"""tools/bench/bench_quality.py's arithmetic: the gas that equalizes tokens per optimizer step (against a
brute force over every gas), and the time and steps to each target (against hand-made curves)."""

import argparse
import math

import pytest

from tools.bench import bench_quality


def brute_force(micro: dict[str, int], epochs: int, tolerance: float) -> dict[str, int]:
    """The smallest odb gas at which every system has some gas (any, up to 400) within
    ``tolerance`` of odb's steps, each system at its closest gas; the steps of a run at gas g are
    ``epochs * ceil(micro / g)`` (an epoch's last step short)."""
    def steps(name, g):
        return epochs * math.ceil(micro[name] / g)

    for odb_gas in range(1, 9):
        target = steps("odb", odb_gas)
        best = {name: min(range(1, 401), key=lambda g, n=name: (abs(steps(n, g) / target - 1), g)) for name in micro}
        if all(abs(target / steps(n, g) - 1) <= tolerance for n, g in best.items() if n != "odb"):
            return {**best, "odb": odb_gas}
    raise AssertionError("no odb gas matches")


@pytest.mark.parametrize("micro", [
    {"odb": 20, "fixed": 150, "gmt": 23, "paper_pkg": 46},  # sharegpt4o at 2 ranks (docs/benchmarks.md)
    {"odb": 26, "fixed": 300, "gmt": 31, "paper_pkg": 64},  # mmmix
    {"odb": 16, "fixed": 44, "gmt": 18, "paper_pkg": 38},  # llava
    {"odb": 37, "fixed": 240, "gmt": 37, "paper_pkg": 61},
])
def test_size_steps_matches_a_brute_force(monkeypatch, micro):
    epochs = 3
    monkeypatch.setattr(bench_quality, "run_steps",
                        lambda system, gas, args, shared: epochs * math.ceil(micro[system] / gas))
    args = argparse.Namespace(systems=list(micro), odb_gas=0, epochs=epochs)
    shared = {"lengths": {i: 100 for i in range(50)}}
    sizes = bench_quality.size_steps(args, shared)
    expected = brute_force(micro, epochs, bench_quality.TOLERANCE)
    steps = {name: epochs * math.ceil(micro[name] / g) for name, g in expected.items()}
    assert {name: row["steps"] for name, row in sizes.items()} == steps
    assert sizes["odb"]["gas"] == expected["odb"]
    for name, row in sizes.items():  # the run's tokens over its steps, within the tolerance of odb's
        assert row["tokens_per_step"] == round(epochs * 5000 / steps[name], 1)
        assert abs(row["tokens_per_step"] / sizes["odb"]["tokens_per_step"] - 1) <= bench_quality.TOLERANCE


def test_time_and_steps_to_each_target():
    result = {"initial_val_loss": 7.0, "systems": {
        "odb": {"curve": [(1.0, 2, 6.0), (2.0, 4, 5.0), (3.0, 6, 4.4), (4.0, 8, 4.5)]},
        "fixed": {"curve": [(2.0, 2, 6.5), (4.0, 4, 5.5), (6.0, 6, 5.0), (8.0, 8, 5.0)]},
        "gmt": {"curve": [(1.5, 2, None), (3.0, 4, 5.9)]},  # an eval without label tokens: no loss
    }}
    out = bench_quality.summarize(result, None)
    # the highest best loss is gmt's 5.9: targets 50%, 80% and 95% of the way from 7.0 down to it
    assert out["targets"] == [6.45, 6.12, 5.955]
    odb, fixed, gmt = (out["systems"][n] for n in ("odb", "fixed", "gmt"))
    assert (odb["best_val_loss"], fixed["best_val_loss"], gmt["best_val_loss"]) == (4.4, 5.0, 5.9)
    assert odb["time_to_target_s"] == [1.0, 1.0, 2.0] and odb["steps_to_target"] == [2, 2, 4]
    assert fixed["time_to_target_s"] == [4.0, 4.0, 4.0] and fixed["steps_to_target"] == [4, 4, 4]
    assert gmt["time_to_target_s"] == [3.0, 3.0, 3.0]
    explicit = bench_quality.summarize(result, [6.2, 5.0, 4.45])
    assert explicit["systems"]["odb"]["steps_to_target"] == [2, 4, 6]
    assert explicit["systems"]["fixed"]["time_to_target_s"] == [4.0, 6.0, None]  # never under 4.45: missed
    assert explicit["systems"]["gmt"]["steps_to_target"] == [4, None, None]


def test_markdown_and_json_shape(tmp_path):
    rows = {name: {"gas": g, "tokens_per_step": 1000.0, "padding_ratio": 0.0, "samples_per_s": 10.0,
                   "curve": [(1.0, 1, 5.0)]} for name, g in (("fixed", 7), ("odb", 2))}
    rows["fixed"]["batch_size"] = 3
    result = bench_quality.summarize({"initial_val_loss": 6.0, "systems": rows}, [5.5, 5.0, 4.0])
    table = bench_quality.markdown(result).splitlines()
    assert table[2].startswith("| fixed (batch 3) | 7 | 1000 | 1.0 (1) | 1.0 (1) | missed | 5.000 |")
    assert table[3].startswith("| odb | 2 | 1000 |")
    for row in result["systems"].values():  # the issue's --json keys
        assert {"time_to_target_s", "steps_to_target", "best_val_loss", "samples_per_s", "tokens_per_step"} <= set(row)


def test_step_breakdown_parts_and_table():
    steps = [{"step_s": 1.0, "data_wait_s": 0.1, "odb_plan_s": 0.02, "odb_collective_s": 0.01, "forward_s": 0.3},
             {"step_s": 2.0, "data_wait_s": 0.0, "odb_plan_s": 0.03, "odb_collective_s": 0.04, "forward_s": 0.9}]
    split = bench_quality.breakdown(steps)
    # by hand: wait 0.1, planning 0.02 + 0.03, collective 0.01 + 0.04, forward 1.2, the rest 3.0 minus those
    assert split == {"data_wait": 0.1, "planning": 0.05, "collective": 0.05, "forward": 1.2, "rest": 1.6}
    rows = {"odb": {"gas": 2, "tokens_per_step": 1000.0, "padding_ratio": 0.0, "samples_per_s": 10.0,
                    "trained_s": 3.0, "curve": [(1.0, 1, 5.0)], "step_breakdown_s": split},
            "paper_pkg": {"gas": 3, "tokens_per_step": 1000.0, "padding_ratio": 0.0, "samples_per_s": 9.0,
                          "trained_s": 3.3, "curve": [(1.0, 1, 5.0)]}}
    table = bench_quality.markdown(bench_quality.summarize({"initial_val_loss": 6.0, "systems": rows},
                                                           [5.5, 5.0, 4.0])).splitlines()
    assert table[-3] == "| system | training s | data_wait s | planning s | collective s | forward s | rest s |"
    assert table[-1] == "| odb | 3.0 | 0.1 | 0.1 | 0.1 | 1.2 | 1.6 |"  # paper_pkg has no metrics rows


def test_each_pass_times_to_the_targets():
    fast, slow = [(1.0, 1, 5.5), (2.0, 2, 4.5)], [(1.5, 1, 5.5), (2.5, 2, 4.6)]
    rows = {"odb": {"curve": fast, "pass_curves": [fast, slow]}}
    out = bench_quality.summarize({"initial_val_loss": 6.0, "systems": rows}, [5.6, 5.0, 4.55])
    assert out["systems"]["odb"]["time_to_target_s"] == [1.0, 2.0, 2.0]
    assert out["systems"]["odb"]["pass_time_to_target_s"] == [[1.0, 2.0, 2.0], [1.5, 2.5, None]]  # 4.6 > 4.55
