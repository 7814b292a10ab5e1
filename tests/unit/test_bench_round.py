"""tools/bench/bench_round.py: the round's cost at scale, from a real 8-rank run's rounds."""

import numpy as np
import pytest

from conftest import tool_module
from odb.batching import align
from odb.batching.config import OdbConfig
from odb.batching.simulate import simulate


def write_trace(path, count=400):
    rng = np.random.default_rng(0)
    path.write_text("".join(f"{int(t)}\n" for t in rng.integers(20, 3000, count)))
    return path


def test_every_round_of_the_run_is_timed_at_each_world_and_the_rows_are_what_ranks_send(tmp_path):
    tool = tool_module("bench_round")
    trace = write_trace(tmp_path / "trace.txt")
    args = ["--trace", str(trace), "--samples_per_rank", "50", "--max_tokens", "4096", "--window", "32",
            "--world_sizes", "8", "64", "--repeat", "1"]
    report = tool.main(args)
    lengths = [(int(t), 0) for t in trace.read_text().split()]
    run = simulate(OdbConfig(max_tokens=4096, window=32), [lengths[i % len(lengths)] for i in range(400)], 8)
    assert report["rounds_recorded"] == report["rounds"] == run.batchers[0].round_index
    assert report["steps"] == len(run.steps[0])
    # the rows as they travel: a real round of the run, packed, holds the proposal's part of the row
    sent = []
    pack = align.Layout.pack
    try:
        align.Layout.pack = lambda self, vector: sent.append(len(pack(self, vector))) or pack(self, vector)
        simulate(OdbConfig(max_tokens=4096, window=32), [lengths[i % len(lengths)] for i in range(400)], 8)
    finally:
        align.Layout.pack = pack
    small, large = report["rows"]
    assert small["world"] == 8 and large["world"] == 64
    # a training run's row adds the fit's part and the telemetry report to the proposal's
    assert small["row_int64"] > np.mean(sent) + 7 + 6
    assert large["received_bytes"] == pytest.approx(8 * large["row_int64"] * 64, rel=1e-3)
    assert large["row_int64"] <= small["row_int64"]  # (the fit sends what the window keeps of a rank: less)
    fixed = tool.main([*args, "--wire", "fixed"])
    assert {row["row_int64"] for row in fixed["rows"]} == {float(tool.round_layout(
        OdbConfig(max_tokens=4096, window=32), 8, 0, fixed=True).size)}
    assert fixed["rows"][1]["gather_ms"] > large["gather_ms"]  # a ring of 63 hops against Bruck's 6 exchanges
