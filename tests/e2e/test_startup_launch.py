"""Start-up for real (launch/train.py): the capability check before any process group, and the waits
before the first step, each announced (``ODB_WAIT_REPORT_S``, shortened here) or bounded.

Oracles: the launch's own output and exit codes (wall time printed, not judged: a loaded machine
stretches it); attention_path called here for the banner.
"""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from launch import ROOT, TRAIN, deepspeed_watched, free_port
from odb.training.attention.cuda import attention_path
from odb.training.backends.process_group import collective_timeout_s
from odb.training.run.watchdog import EXIT_STALLED


def plain(args: list[str], *, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    """launch/train.py as one process, no launcher, with ``env`` added to this one's."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(TRAIN), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, "PYTHONUNBUFFERED": "1", **env}, cwd=ROOT)


def test_a_stale_extension_lock_is_named_and_ends_the_launch_within_the_timeout(tmp_path, monkeypatch):
    """A lock file left in the extension cache, as a build killed while holding it leaves it: every rank
    of ``deepspeed launch/train.py`` waits in torch's build lock before its process group. Each says
    which file it waits for, then ends after ``--dist_timeout_s`` naming the file to delete, instead of
    waiting for ever with no output."""
    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("ODB_WAIT_REPORT_S", "1")
    began = time.monotonic()
    code, output, _ = deepspeed_watched(["--dist_timeout_s", "5", "--output_dir", str(tmp_path / "out")], timeout=180)
    seconds = time.monotonic() - began
    print(f"stale lock: the launch ended with {code} after {seconds:.0f} s")
    assert code != 0 and f"exits with return code = {EXIT_STALLED}" in output, output[-3000:]
    for rank in (0, 1):
        assert re.search(rf"odb: rank {rank}: waiting \d+ s for DeepSpeed's communication op .*: for the lock "
                         rf"{re.escape(str(lock))} of torch's C\+\+ extension build", output), output[-3000:]
    # the first rank to end does (the launcher then stops the other, which may not have said it yet)
    assert re.search(rf"odb: rank [01]: {re.escape(str(lock))} has been there for \d+ s with no build running .* "
                     rf"Delete it \(rm {re.escape(str(lock))}\)", output), output[-3000:]
    assert lock.exists()  # (odb names the file; deleting it is the user's call)


def test_a_rank_alone_at_the_rendezvous_says_so_and_gives_up_in_time(tmp_path):
    """Rank 0 of 2 started without rank 1: it reports what it waits for (the rendezvous address and the
    ranks) and ends when the process group's timeout says (its output names that bound)."""
    port = free_port()
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ODB_WAIT_REPORT_S": "2", "DS_ACCELERATOR": "cpu",
           "PYTHONUNBUFFERED": "1"}
    bound = collective_timeout_s(2)
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(TRAIN), "--dist_timeout_s", "2", "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=bound + 120, env=env, cwd=ROOT)
    seconds = time.monotonic() - began
    print(f"alone at the rendezvous: exit {proc.returncode} after {seconds:.0f} s (the bound: {bound:.0f} s)")
    reports = re.findall(rf"odb: rank 0: waiting (\d+) s for .*the other ranks to join the process group \(2 ranks, "
                         rf"rendezvous at 127\.0\.0\.1:{port}\); every rank must be started .* gives up after "
                         rf"{bound:.0f} s", proc.stderr)
    assert proc.returncode != 0 and len(reports) >= 3, proc.stderr[-3000:]
    assert "1/2 clients joined" in proc.stderr  # (when: the printed seconds; the subprocess timeout bounds a hang)


def test_the_banner_names_the_probed_attention_path_and_the_model_load_is_announced(tmp_path):
    """One process, one step: the start banner names the path attention_path finds for the CPU in
    fp32, and the model load reports itself while it lasts."""
    env = {"ODB_WAIT_REPORT_S": "0.2"}
    proc = plain(["--max_steps", "1", "--max_samples", "16", "--num_workers", "0", "--no_final_checkpoint",
                  "--output_dir", str(tmp_path / "out")], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "odb_varlen: " + attention_path(torch.device("cpu"), torch.float32)
    banner = next(line for line in proc.stdout.splitlines() if line.startswith("odb: world_size"))
    assert f"attention {expected}," in banner, banner
    assert re.search(r"odb: rank 0: waiting \d+ s for the model .*tiny_model\.json to load and deepspeed to set it "
                     r"up; a large model on network storage", proc.stderr), proc.stderr[-3000:]


@pytest.mark.parametrize("backend", ["fsdp2"])
def test_a_torch_without_what_the_backend_needs_stops_the_rank_before_any_process_group(tmp_path, backend):
    """A torch without ``torch.distributed.fsdp.fully_shard`` (as before 2.6), made here by deleting it
    at interpreter start: ``--backend fsdp2`` stops at once, naming the torch to install, before any
    process group or wait."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import torch.distributed.fsdp\ndel torch.distributed.fsdp.fully_shard\n")
    proc = plain(["--backend", backend, "--output_dir", str(tmp_path / "out")], env={"PYTHONPATH": str(shim)},
                 timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"odb: rank 0: --backend fsdp2 needs torch.distributed.fsdp.fully_shard, which torch {torch.__version__} "
        "lacks: pip install 'torch>=2.6', or train with --backend deepspeed"), proc.stderr[-3000:]
    assert "waiting" not in proc.stderr and not (tmp_path / "out").exists()
