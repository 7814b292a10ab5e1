#!/usr/bin/env python
"""Fine-tune with odb under DeepSpeed (the default) or FSDP2.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/ds_zero2.json
    torchrun --nproc_per_node 2 launch/train.py --backend fsdp2 --fsdp_config configs/fsdp2.json

With no flags: the bundled tiny model on the bundled chat data, one epoch (CPU ranks on gloo
where there is no GPU). ``python launch/train.py --help`` lists the flags.
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from odb.training.cli import FileDefaults, parse_config  # noqa: E402
from odb.training.environment import check_network, rank_environment  # noqa: E402
from odb.training.faults import EXIT_PREEMPTED, Preempted  # noqa: E402
from odb.training.run import Trainer, end_process  # noqa: E402
from odb.training.startup import StartupError, check_startup  # noqa: E402

DEFAULTS = FileDefaults.bundled(REPO)


def main() -> None:
    rank_environment()  # under srun (launch/slurm.sbatch): RANK, WORLD_SIZE, ... from SLURM's variables
    check_network()
    config = parse_config(defaults=DEFAULTS)  # every input checked here, before any process group
    try:  # what this rank runs: torch, the backend's APIs, the packed attention path on its device
        check_startup(config)
    except StartupError as error:
        sys.exit(f"odb: rank {os.environ.get('RANK', '0')}: {error}")
    trainer = Trainer.init(config)  # from here on every wait before the first step is announced or bounded
    try:
        trainer.build()
        trainer.train()
        trainer.finish()
    except Preempted as stop:  # SIGTERM / SIGUSR1: every rank saved at the same step
        trainer.shutdown(stop)
        trainer.log(f"odb: {stop}")
        end_process(EXIT_PREEMPTED)
    except BaseException as error:
        trainer.shutdown(error)  # local: workers, files, W&B (failed), process group
        raise
    else:
        trainer.shutdown()
        end_process(0)  # (skips the interpreter's teardown of the libraries' modules: see end_process)


if __name__ == "__main__":
    main()
