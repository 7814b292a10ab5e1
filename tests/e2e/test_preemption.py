"""SIGTERM (SLURM's warning before it kills a job, or scancel) or SIGUSR1 to any one rank: every
rank stops after the same step, saves, exits with EXIT_PREEMPTED; ``--resume`` continues exactly."""

from __future__ import annotations

import time
from collections import Counter

from launch import Run, audit, ds_config, odb_config, steps_trained
from odb.training.faults import EXIT_PREEMPTED

SAMPLES = 600


def test_sigterm_to_one_rank_saves_at_one_step_everywhere_and_the_resume_is_exact(tmp_path):
    out = tmp_path / "out"
    args = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--odb_config",
            str(odb_config(tmp_path, max_tokens=1024, window=32, lookahead=16)), "--output_dir", str(out),
            "--audit_ids", "--max_samples", str(SAMPLES), "--dist_timeout_s", "60"]
    run = Run(args, nproc=2)
    try:
        run.wait_for(lambda: steps_trained(out) >= 3)
        run.rank_process(1).terminate()  # SIGTERM
        signalled = time.monotonic()
        [code] = run.wait(90)
        elapsed = time.monotonic() - signalled
    finally:
        run.kill()
    output = run.output()
    print(f"SIGTERM: exit {code} {elapsed:.1f} s after the signal")
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert elapsed < 60
    first = audit(out, 2)
    stopped = [max(row["step"] for row in rows) + 1 for rows in first]
    assert stopped[0] == stopped[1], "every rank stops after the same step"
    tag = (out / "checkpoints" / "latest").read_text().strip()
    assert tag == f"step{stopped[0]}" and f"checkpoint {tag} saved" in output
    assert not (out / "summary.json").exists()

    Run([*args, "--resume"], nproc=2).wait(420)
    rows = [row for rank_rows in audit(out, 2) for row in rank_rows]
    assert Counter(i for row in rows for i in row["ids"]) == Counter(range(SAMPLES)), "each sample exactly once"
    resumed = [row for r, rank_rows in enumerate(audit(out, 2)) for row in rank_rows[len(first[r]):]]
    assert min(row["step"] for row in resumed) == stopped[0]
    assert (out / "summary.json").exists()
