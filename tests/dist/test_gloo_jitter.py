"""Stragglers and jitter with real processes: 3 ranks on gloo (torchrun), random delays before
every fetch, after every step and (behind odb's DataLoader feed) in the workers per sample, one
rank 6-10x slower. The ranks run truly in parallel here, so the fast ones reach each round's
collective first and wait for the straggler.

Every batcher decision is a pure function of the gathered data, so the jittered plans must
equal the jitter-free plan of the same config and data, computed here in one process over
simulated ranks (:func:`odb.batching.simulate.simulate`): an oracle that shares no
communicator with the run. Alignment (I1), exact-once coverage in join mode (I2), the quota in
quota mode and the step label-token counts (I4) are checked directly as well. Each launch has a
timeout, so a hang fails the test instead of stalling CI.
"""

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import check_aligned, check_exact_once, check_label_tokens, simulated_labels
from launch import free_port
from odb.batching.config import OdbConfig
from odb.batching.simulate import simulate
from odb.batching.state import decode_steps

WORKER = Path(__file__).with_name("jitter_worker.py")
WORLD = 3
DELAYS_S = {"fetch": 0.005, "step": 0.002, "record": 0.001}

SCENARIOS = {  # seed -> (config, epochs, feed, number of samples)
    0: ({"max_tokens": 256, "window": 8, "gas": 2, "lookahead": 4, "sharding": "dynamic"}, 2, "simulated", 150),
    1: ({"max_tokens": 256, "window": 6, "gas": 3, "lookahead": 2, "sharding": "static"}, 1, "loader", 120),
    2: ({"max_tokens": 192, "window": 8, "gas": 1, "lookahead": 4, "mode": "quota", "quota": 170}, 1, "loader", 80),
}


def scenario(seed: int) -> dict:
    config, epochs, feed, num_samples = SCENARIOS[seed]
    rng = random.Random(seed)
    lengths = [None if rng.random() < 0.03 else [rng.randint(1, config["max_tokens"] + 30), 0]
               for _ in range(num_samples)]  # a few skipped records, a few over the cap (truncated)
    straggler = rng.randrange(WORLD)
    slowness = [rng.uniform(6.0, 10.0) if r == straggler else 1.0 for r in range(WORLD)]
    return {"config": {**config, "seed": seed}, "epochs": epochs, "feed": feed, "lengths": lengths,
            "seed": seed, "slowness": slowness, "delays_s": DELAYS_S}


def launch(tmp_path: Path, spec: dict) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(tmp_path),
           json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def overlapped(sleeps: list[list[list[float]]]) -> bool:
    """Whether a sleep of one rank overlapped a sleep of another (the ranks ran concurrently)."""
    spans = sorted((a, b, r) for r, spans in enumerate(sleeps) for a, b in spans if b > a)
    latest_end, latest_rank = float("-inf"), -1
    for start, end, rank in spans:
        if start < latest_end and rank != latest_rank:
            return True
        if end > latest_end:
            latest_end, latest_rank = end, rank
    return False


@pytest.mark.parametrize("seed", sorted(SCENARIOS))
def test_jittered_processes_follow_the_jitter_free_plan(tmp_path, seed):
    spec = scenario(seed)
    results = launch(tmp_path, spec)
    steps = [decode_steps(r["steps"]) for r in results]
    lengths = [None if x is None else tuple(x) for x in spec["lengths"]]
    calm = simulate(OdbConfig(**spec["config"]), lengths, WORLD, num_epochs=spec["epochs"], timeout_s=60)
    assert steps == calm.steps, "the plan depends on timing"
    check_aligned(steps)
    check_label_tokens(steps, simulated_labels(lengths), spec["config"]["max_tokens"])
    assert all(r["collectives"] == r["rounds"] + 1 == calm.batchers[0].round_index + 1 for r in results)
    trained = [u for rank_steps in steps for s in rank_steps for m in s.micro_batches for u in m.uids]
    if spec["config"].get("mode") == "quota":
        assert len(trained) == len(set(trained)) == spec["config"]["quota"]
    else:
        kept = [i for i, x in enumerate(lengths) if x is not None]
        check_exact_once(steps, Counter(e * len(lengths) + i for e in range(spec["epochs"]) for i in kept))
    # the jitter did what it is for: the ranks slept at the same time, and the fast ones waited
    # for the straggler in the round's collective
    assert overlapped([r["sleeps"] for r in results])
    straggler = max(range(WORLD), key=lambda r: spec["slowness"][r])
    waits = [r["collective_s"] for r in results]
    assert all(waits[r] > waits[straggler] for r in range(WORLD) if r != straggler), waits
