"""SIGTERM (SLURM's warning before it kills a job, or scancel) or SIGUSR1 to any one rank: every
rank stops after the same step, saves, exits with EXIT_PREEMPTED; ``--resume`` continues exactly,
also on another number of ranks (odb re-deals the untrained samples; DeepSpeed's universal
checkpoint reshapes the model and optimizer)."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import pytest

from launch import Run, audit, deepspeed, ds_config, odb_config, steps_trained
from odb.training.run.stop import EXIT_PREEMPTED

SAMPLES = 400


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


# (the same-world resume is tests/e2e/test_train.py's; the stop itself is the same on either path)
@pytest.mark.parametrize("old_world,new_world,stage,sig,rank", [
    (2, 3, 2, signal.SIGUSR1, 0),
    (3, 2, 3, signal.SIGTERM, 2),
], ids=["2-3-zero2-sigusr1", "3-2-zero3-sigterm"])
def test_a_signal_to_one_rank_saves_at_one_step_everywhere_and_the_resume_is_exact(
        tmp_path, old_world, new_world, stage, sig, rank):
    out = tmp_path / "out"
    args = ["--deepspeed_config", str(ds_config(tmp_path, stage)), "--odb_config",
            str(odb_config(tmp_path, max_tokens=1024, window=32, lookahead=16)), "--output_dir", str(out),
            "--audit_ids", "--max_samples", str(SAMPLES), "--dist_timeout_s", "60"]
    run = Run(args, nproc=old_world)
    try:
        run.wait_for(lambda: steps_trained(out) >= 4)
        run.rank_process(rank).send_signal(sig)
        signalled = time.monotonic()
        [code] = run.wait(300)  # (a bound against a hang only: the stop's time is printed, not judged)
        elapsed = time.monotonic() - signalled
    finally:
        run.kill()
    output = run.output()
    print(f"{sig.name} to rank {rank} of {old_world}: exit {code} {elapsed:.1f} s after the signal")
    assert code == EXIT_PREEMPTED, output[-3000:]
    first = audit(out, old_world)
    stopped = {max(row["step"] for row in rows) + 1 for rows in first}
    assert len(stopped) == 1, "every rank stops after the same step"
    tag = (out / "checkpoints" / "latest").read_text().strip()
    assert tag == f"step{stopped.pop()}" and f"checkpoint {tag} saved" in output
    assert not (out / "summary.json").exists()
    before = losses(out)

    resumed = deepspeed([*args, "--resume"], nproc=new_world)  # (it must exit 0)
    if old_world != new_world:
        assert f"saved by {old_world} ranks, its untrained samples dealt to {new_world}" in resumed.stdout
    rows = [row for rank_rows in audit(out, max(old_world, new_world)) for row in rank_rows]
    assert Counter(i for row in rows for i in row["ids"]) == Counter(range(SAMPLES)), "each sample exactly once"
    after = {step: loss for step, loss in losses(out).items() if step >= int(tag[4:])}
    assert min(after) == int(tag[4:]), "the steps go on from the checkpoint"
    assert sorted(before) == list(range(int(tag[4:]))), "the stopped run wrote a metrics row for every step"
    # the loss goes on where it was: no jump back to the start (weights lost) or up (Adam's state lost)
    last_before = [before[s] for s in sorted(before)[-3:]]
    first_after = [after[s] for s in sorted(after)[:3]]
    print(f"loss: first {before[0]:.4f}, last 3 before {last_before}, first 3 after {first_after}")
    assert max(first_after) < max(last_before) + 0.3 and max(first_after) < before[0] - 0.3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_emitted"] == SAMPLES and summary["world_size"] == new_world
