"""Real processes on gloo (torchrun), deliberately uneven shards; each run has a timeout so that
a hang fails the test instead of stalling CI."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import check_aligned, check_exact_once, check_label_tokens, simulated_labels
from launch import free_port
from odb.batching.state import decode_steps

WORKER = Path(__file__).with_name("gloo_worker.py")


def launch(tmp_path, world: int, scenario: dict) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(tmp_path),
           json.dumps(scenario)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def steps_of(results):
    return [decode_steps(r["steps"]) for r in results]


@pytest.mark.parametrize("world", [1, 5, 8])
def test_the_gather_hands_every_rank_every_rows_values_in_rank_order(tmp_path, world):
    """TorchCommunicator's Bruck all_gather over real gloo processes, rows of different lengths (some
    empty), against what each rank sent; and the fixed-length gather as a matrix."""
    sizes = [(3 * r + 2) % 5 for r in range(world)]
    results = launch(tmp_path, world, {"gather": sizes})
    expected = [r * 1000 + i for r in range(world) for i in range(sizes[r])]
    for result in results:
        assert result["rows"] == expected and result["lengths"] == sizes
        assert result["matrix"] == [[r, -r] for r in range(world)]


def test_two_ranks_with_shards_of_5_and_45_samples(tmp_path):
    lengths = [(7 * i) % 90 + 5 for i in range(50)]
    shards = [list(range(0, 5)), list(range(5, 50))]  # base + rank * offset
    results = launch(tmp_path, 2, {"config": {"max_tokens": 128, "window": 8, "gas": 2, "sharding": "static"},
                                   "lengths": lengths, "shards": shards})
    steps = steps_of(results)
    check_aligned(steps)
    check_exact_once(steps, Counter(range(50)))
    check_label_tokens(steps, simulated_labels(lengths), 128)
    # analytic totals: all label tokens (tokens - 1 each) are trained, on rank 0 only 5 samples
    assert sum(s.num_label_tokens for s in steps[0]) == sum(t - 1 for t in lengths)
    assert sorted(u for s in steps[0] for m in s.micro_batches for u in m.uids) == list(range(5))
    assert all(r["collectives"] == r["rounds"] + 1 for r in results)


def test_four_ranks_one_empty_dynamic_and_static(tmp_path):
    lengths = [(13 * i) % 200 + 1 for i in range(120)]
    shards = [list(range(0, 10)), [], list(range(10, 30)), list(range(30, 120))]
    static = launch(tmp_path, 4, {"config": {"max_tokens": 256, "window": 16, "gas": 3, "sharding": "static"},
                                  "lengths": lengths, "shards": shards})
    check_aligned(steps_of(static))
    check_exact_once(steps_of(static), Counter(range(120)))
    dynamic = launch(tmp_path, 4, {"config": {"max_tokens": 256, "window": 16, "gas": 3},
                                   "lengths": lengths, "epochs": 2})
    check_aligned(steps_of(dynamic))
    check_exact_once(steps_of(dynamic), Counter(range(240)))
    check_label_tokens(steps_of(dynamic), simulated_labels(lengths), 256)


def test_three_ranks_quota_mode(tmp_path):
    lengths = [(11 * i) % 60 + 1 for i in range(40)]
    results = launch(tmp_path, 3, {"config": {"max_tokens": 128, "window": 8, "gas": 2, "mode": "quota",
                                              "quota": 101}, "lengths": lengths})
    steps = steps_of(results)
    check_aligned(steps)
    assert sum(len(m.samples) for rank in steps for s in rank for m in s.micro_batches) == 101


def test_mismatched_settings_fail_on_every_rank_naming_the_keys(tmp_path):
    results = launch(tmp_path, 2, {"config": {"max_tokens": 128, "window": 8}, "lengths": [5] * 10,
                                   "per_rank": {"1": {"max_tokens": 256}}})
    for result in results:
        assert "SettingsMismatch" in result["error"] and "'max_tokens': rank(s) [1] differ" in result["error"]
