"""One rank's run, start to end: parse -> check -> init -> build -> train -> finish, the process
ending with the run's exit code. ``launch/train.py`` (flags) and ``odb train`` under a launcher (a
recipe, :mod:`odb.recipe`) both run it; the training loop itself is :class:`~odb.training.run.loop.Trainer`'s."""

from __future__ import annotations

import os
import sys

from odb.recipe import Recipe
from odb.training.config.environment import check_network, rank_environment
from odb.training.launch.flags import FileDefaults, parse_config

__all__ = ["main"]


def main(argv: list[str] | None = None, *, defaults: FileDefaults | None = None, recipe: Recipe | None = None
         ) -> None:
    """Runs this rank (``argv``: launch/train.py's flags, default ``sys.argv[1:]``, over ``recipe``'s)
    and ends the process: 0 when the run finished, :data:`~odb.training.run.stop.EXIT_PREEMPTED` after
    a requested stop (every rank saved at the same step); a failure raises (exit 1)."""
    rank_environment()  # under srun (launch/slurm.sbatch): RANK, WORLD_SIZE, ... from SLURM's variables
    check_network()
    defaults = FileDefaults.bundled() if defaults is None else defaults
    try:  # every input checked, before any process group and before torch's import: a typo fails in a second
        config = parse_config(argv, defaults=defaults, recipe=recipe)
    except (ValueError, FileNotFoundError, NotADirectoryError) as error:  # (argparse's exit 2 with its usage)
        sys.exit(f"odb: rank {os.environ.get('RANK', '0')}: {error}")
    from odb.training.run.loop import Trainer
    from odb.training.run.startup import StartupError, check_startup
    from odb.training.run.stop import EXIT_PREEMPTED, Preempted
    from odb.training.run.teardown import end_process

    try:  # what this rank runs: torch, the backend's APIs, the packed attention path on its device
        check_startup(config)
        trainer = Trainer.init(config)  # (a rendezvous port another run holds); from here on every wait
    except StartupError as error:       # before the first step is announced or bounded
        sys.exit(f"odb: rank {os.environ.get('RANK', '0')}: {error}")
    try:
        trainer.build()
        trainer.train()
        trainer.finish()
    except Preempted as stop:  # SIGTERM / SIGUSR1: every rank saved at the same step
        trainer.shutdown(stop)
        trainer.log(f"odb: {stop}")
        end_process(EXIT_PREEMPTED)
    except BaseException as error:
        trainer.shutdown(error)  # local: workers, files, the trackers (failed), process group
        raise
    else:
        trainer.shutdown()
        end_process(0)  # (skips the interpreter's teardown of the libraries' modules: see end_process)


if __name__ == "__main__":
    main()
