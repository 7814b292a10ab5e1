"""``torchrun --max-restarts``: a restarted attempt never reads the failed attempt's keys in the
rendezvous store, which torchrun keeps across restarts (odb's stop step and abort, and torch's own
process-group rendezvous: odb/training/run/watchdog.py puts both under the attempt's prefix); the
trainer's restarted attempt continues the run (``--resume auto``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from launch import ROOT, TRAIN, audit, free_port, odb_config, steps_trained

SAMPLES = 120
WORKER = Path(__file__).resolve().parent / "restart_worker.py"
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def torchrun_restarting(port: int) -> list[str]:
    """torchrun with one restart, under the c10d rendezvous (the elastic one; its store, the
    agent's, lives across restarts as the static one's does)."""
    return [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc_per_node", "2",
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]


def test_the_keys_of_a_failed_attempt_do_not_reach_the_restarted_one(tmp_path):
    """tests/e2e/restart_worker.py: attempt 0 agrees on a stop step, publishes an abort and exits;
    attempt 1 runs all 8 of its steps (it stopped at attempt 0's step 4, or exited 71 on its abort,
    or failed to form its process group at all)."""
    proc = subprocess.run([*torchrun_restarting(free_port()), str(WORKER), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"attempt1.rank{rank}.json").read_text()) == {"steps": 8, "stopped_at": None}


def worker(launcher: psutil.Process, rank: int) -> psutil.Process | None:
    """The launch/train.py process of ``rank`` under ``launcher`` (its environment says RANK)."""
    for child in launcher.children(recursive=True):
        try:
            if any("train.py" in part for part in child.cmdline()) and child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    return None


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_a_restarted_attempt_resumes_and_does_not_stop_at_the_old_attempts_stop_step(tmp_path, backend):
    """Attempt 0: SIGUSR1 to rank 1 after a few steps; every rank stops at the agreed step, saves and
    exits 75; torchrun starts attempt 1 with the same command. It read attempt 0's stop step from
    the store and stopped after its first step (exit 75 again, torchrun out of restarts: exit 1).
    Now it resumes from the checkpoint and trains the rest: every sample exactly once over both."""
    out, port = tmp_path / "out", free_port()
    cmd = [*torchrun_restarting(port), str(TRAIN), "--backend", backend, "--resume", "auto", "--audit_ids",
           "--max_samples", str(SAMPLES), "--odb_config", str(odb_config(tmp_path, max_tokens=256, window=8)),
           "--output_dir", str(out), "--num_workers", "0", "--dist_timeout_s", "60"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 300
            while steps_trained(out) < 3:
                assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it trained"
                time.sleep(0.2)
            victim = worker(launcher, 1)
            assert victim is not None, "rank 1's process"
            victim.send_signal(signal.SIGUSR1)
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait()
        log.seek(0)
        output = log.read()
    stopped = re.findall(r"checkpoint (step\d+) saved", output)
    print(f"attempt 0 stopped with checkpoint {stopped}; torchrun exit {code}")
    assert stopped, output[-3000:]
    assert code == 0, output[-5000:]
    assert f"resumed from {out / 'checkpoints'}" in output, output[-3000:]
    rows = [row for rank_rows in audit(out, 2) for row in rank_rows]
    assert Counter(i for row in rows for i in row["ids"]) == Counter(range(SAMPLES)), "each sample exactly once"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_emitted"] == SAMPLES
