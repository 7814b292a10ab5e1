"""GracefulStop (odb/training/run/stop.py) without training: the step every rank agrees on through a real
TCPStore, and the exit code of a rank that SLURM signals again while it already exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import torch.distributed as dist

from launch import free_port
from odb.training.run.stop import EXIT_PREEMPTED, GracefulStop


def test_every_rank_stops_after_the_step_the_signalled_rank_proposed():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=10), wait_for_workers=False)
    ranks = [GracefulStop(dist.TCPStore("127.0.0.1", port, 3, False, timedelta(seconds=10)), rank=r)
             for r in range(3)]
    previous = {sig: signal.getsignal(sig) for sig in GracefulStop.SIGNALS}
    try:
        ranks[1].install()
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal to this process: rank 1's handler runs
        time.sleep(0.1)
        assert ranks[1].signal == "SIGUSR1" and ranks[0].signal is None
        # after step 4, rank 0 looks before rank 1 proposes 4 + 2; rank 2 looks after
        assert [r.should_stop(4) for r in ranks] == [False] * 3
        assert [r.stop_after for r in ranks] == [None, 6, 6]
        ranks[2].signal = "SIGTERM"  # a later signal elsewhere does not move the agreed step
        assert [r.should_stop(5) for r in ranks] == [False] * 3  # rank 0 reads it one step later: in time
        assert [r.stop_after for r in ranks] == [6, 6, 6]
        assert [r.should_stop(6) for r in ranks] == [True] * 3
    finally:
        for sig, handler in previous.items():  # install() and the agreed stop (SIG_IGN) changed them
            signal.signal(sig, handler)
        del server


EXITING = textwrap.dedent("""
    import sys, time
    from odb.training.run.stop import EXIT_PREEMPTED, GracefulStop

    stop = GracefulStop(None, rank=0).install()
    if sys.argv[1] == "agreed":
        stop.ignore_further_signals()

    class SlowTeardown:  # stands for torch's module teardown, after Python's signal handling has ended
        def __del__(self, sleep=time.sleep):
            sleep(3)

    keep = SlowTeardown()
    print("exiting", flush=True)
    sys.exit(EXIT_PREEMPTED)
""")


def _exit_code_under_sigterm(mode: str) -> int:
    """Runs a rank's exit while SIGTERM arrives every 0.1 s, as srun --kill-on-bad-exit sends it once
    another rank has exited 75."""
    proc = subprocess.Popen([sys.executable, "-c", EXITING, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "exiting"
    while proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    return proc.returncode


def test_a_rank_that_agreed_to_stop_exits_75_even_when_signalled_again_during_its_exit():
    assert _exit_code_under_sigterm("agreed") == EXIT_PREEMPTED
    # the control: with only the Python handler, the same SIGTERM kills the exiting process (143 in a shell)
    assert _exit_code_under_sigterm("handler") == -signal.SIGTERM
