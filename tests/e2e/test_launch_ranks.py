"""tests/launch.py's ``_ranks``, which starts most of the suite's runs (one process per rank, no
launcher), on scripts that only read their rank's environment: what it reports when a rank fails,
when the others then do not end, and when the time runs out."""

from __future__ import annotations

import subprocess
import time

import pytest

import launch
from launch import KILLED, _ranks, launch_env

SCRIPT = """
import os, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"rank {rank} of {world}, local {os.environ['LOCAL_RANK']}, port {os.environ['MASTER_PORT']}", flush=True)
{body}
"""


def run(tmp_path, body: str, nproc: int = 3, timeout: float = 60):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT.replace("{body}", body))
    return _ranks(script, [], nproc, launch_env(), timeout)


def test_every_rank_gets_its_environment_and_a_clean_run_reports_0(tmp_path):
    done, port = run(tmp_path, "sys.exit(0)")
    assert done.returncode == 0 and KILLED not in done.stderr
    for rank in range(3):
        assert f"rank {rank} of 3, local {rank}, port {port}" in done.stdout


def test_the_ranks_of_a_test_launch_are_forked_from_the_zygote_with_its_imports(tmp_path):
    """What deepspeed() and fsdp2() give their ranks is served by the zygote (it was not, for a
    while, and nothing said so: numpy's OpenBLAS had started a thread in it): each rank starts with
    torch imported, in its own process whose parent is the zygote, and torch keeps one thread. A
    launch with an environment of its own first (it was the first launch of a test process, and the
    zygote it started served none of the others) gets a zygote of its own."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nprint('imported' if 'torch' in sys.modules else 'fresh', os.getppid())\n"
                      "import torch\nprint('threads', torch.get_num_threads())\n")
    for env in (launch_env(TEST_OWN_ENVIRONMENT="1"),
                launch_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", LOCAL_SIZE="2"),
                launch_env(PYTHONUNBUFFERED="1")):
        done, _ = _ranks(script, [], 2, env, 120)
        assert done.returncode == 0, done.stderr
        zygote = launch.Zygote.serving(env)  # (the one that served the launch)
        assert done.stdout.count(f"imported {zygote.proc.pid}") == 2, done.stdout
        assert done.stdout.count("threads 1") == 2, done.stdout


def test_the_first_failure_is_reported_last_and_its_code_returned_after_the_others_end(tmp_path):
    """Rank 1 fails at once; ranks 0 and 2 end on their own 1 s later, with a code of their own and
    long output: the result is rank 1's code, and its message ends the output."""
    body = ("if rank == 1:\n    sys.exit('rank 1: the first failure')\n"
            "time.sleep(1)\nsys.stderr.write('x' * 6000)\nsys.exit(5)")
    done, _ = run(tmp_path, body)
    assert done.returncode == 1  # (sys.exit with a message), not the others' 5
    assert "rank 1: the first failure" in (done.stdout + done.stderr)[-5000:]
    assert KILLED not in done.stderr


def test_ranks_still_running_after_a_failure_are_killed_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 1)
    started = time.monotonic()
    done, _ = run(tmp_path, "if rank == 0:\n    sys.exit(3)\ntime.sleep(60)")
    assert done.returncode == 3 and time.monotonic() - started < 30
    assert f"{KILLED}: rank(s) [1, 2] still running 1 s after rank 0 failed" in done.stderr


def test_a_run_past_its_time_is_killed_with_its_output(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run(tmp_path, "time.sleep(60)", nproc=2, timeout=3)
    assert "rank 1 of 2" in err.value.output
