"""One rank of tests/e2e/test_torchrun_restarts.py's store test, under ``torchrun --max-restarts 1``.

Usage: torchrun --nproc_per_node 2 --max-restarts 1 ... tests/e2e/restart_worker.py OUT_FOLDER

odb's fault handling without the model: the process group formed through
:func:`odb.training.backends.process_group.process_group_kwargs`, the rendezvous-store clients of
:func:`odb.training.backends.process_group.connect_store`, a barrier as each "step"'s collective.

* Attempt 0 (``TORCHELASTIC_RESTART_COUNT`` 0): rank 1 is signalled after step 2 (its
  :class:`GracefulStop` flag set as its handler would), every rank stops at the agreed step; then
  rank 0 fails (its watchdog publishes the abort, as a rank that raised does) and every rank exits
  75: torchrun restarts them all.
* Attempt 1: no signal; 8 steps, each asking ``should_stop``, while the watchdog runs past the
  grace after an abort. Each rank writes ``attempt1.rank<R>.json`` (its steps) and exits 0. Keys
  of attempt 0 read here would stop it at step 4 or end it with exit 71.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's odb

from odb.training.backends.process_group import connect_store, process_group_kwargs
from odb.training.run.stop import EXIT_PREEMPTED, GracefulStop
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.run.watchdog import Watchdog

TIMEOUT_S = 4.0  # heartbeats every 0.5 s, a peer's abort acted on 1.5 s after it is read


def main() -> None:
    out, attempt = Path(sys.argv[-1]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", **process_group_kwargs(30))
    rank, world = dist.get_rank(), dist.get_world_size()
    exits: list[int] = []
    watchdog = Watchdog(connect_store(30), rank=rank, world_size=world, timeout_s=TIMEOUT_S,
                        exit=lambda code: (exits.append(code), os._exit(code))).start()
    stop = GracefulStop(connect_store(30), rank=rank)
    steps = 0
    for step in range(8):
        dist.barrier()  # the step's collective: no rank finishes a step before every rank joined it
        steps += 1
        if attempt == 0 and rank == 1 and step == 1:
            stop.signal = "SIGUSR1"
        if stop.should_stop(steps):
            break
        time.sleep(0.5)  # 4 s over 8 steps: past the grace after an abort of attempt 0
    if attempt == 0:
        dist.barrier()
        if rank == 0:
            watchdog.stop(RuntimeError("attempt 0 fails"))  # publishes the abort key
        dist.barrier()
        time.sleep(1.0)
        os._exit(EXIT_PREEMPTED)
    (out / f"attempt1.rank{rank}.json").write_text(json.dumps({"steps": steps, "stopped_at": stop.stop_after}))
    dist.barrier()
    watchdog.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
