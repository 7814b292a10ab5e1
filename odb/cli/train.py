"""``odb train RECIPE [key=value ...] [--nproc N]``: a recipe's run (:mod:`odb.recipe`).

Where it runs depends on who started it:

* from a shell (no launcher): it starts the ranks on this machine with the run's backend's launcher
  (DeepSpeed's runner, ``deepspeed --num_gpus N``; torchrun for FSDP2), each rank running this
  command again, now under that launcher; ``odb train`` becomes the launcher (exec), so its exit
  code and signals are the launcher's. One rank runs in this process, no launcher.
* under a launcher (``RANK`` / ``LOCAL_RANK`` set: deepspeed, torchrun) or in a SLURM step
  (``srun odb train ...``): this process is one rank (:func:`odb.training.launch.main.main`), and
  ``nproc`` is not read.

The recipe is checked before any rank starts: its keys, the values the flags take, the launcher.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from odb.recipe import Recipe, load_recipe

__all__ = ["launch_command", "main", "under_launcher"]

RANK_MODULE = "odb.cli"
"""What each rank runs (``python -m odb.cli train ...``)."""


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Train from a recipe: launch/train.py's flags, without their dashes, as the keys of "
                               "a YAML file (docs/recipes.md). Without a launcher it starts the ranks on this "
                               "machine; under one (deepspeed, torchrun, srun) it runs as one rank.",
        epilog="e.g. odb train demo --nproc 2 max_samples=100 output_dir=runs/try; odb recipes lists the bundled "
               "recipes")
    p.add_argument("recipe", help="a recipe file (.yaml), or the name of a bundled one (demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="over the recipe's values: any of its keys (launch/train.py's flags without the dashes), "
                        "e.g. lr=1e-5 save_hf=true deepspeed_config=my_ds.json")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to start on this machine (default: the recipe's nproc, else one per GPU, else 1)")
    p.add_argument("--master_port", type=int, default=None, help="the ranks' rendezvous port (default: a free one)")
    return p


def under_launcher(env: Mapping[str, str]) -> bool:
    """Whether a launcher started this process as one of its ranks: deepspeed and torchrun set
    ``RANK`` and ``LOCAL_RANK``; ``srun`` sets SLURM's step variables
    (:func:`odb.training.config.environment.rank_environment` reads them)."""
    return "RANK" in env or "LOCAL_RANK" in env or ("SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env)


def _nproc(recipe: Recipe, given: int | None) -> int:
    """``--nproc``, else the recipe's ``nproc``, else one rank per GPU here, else 1."""
    value = given if given is not None else recipe.get("nproc")
    if value is None:
        import torch

        return max(1, torch.cuda.device_count())
    try:
        nproc = int(value)
    except (TypeError, ValueError):
        nproc = 0
    if nproc < 1 or isinstance(value, (bool, float)):
        raise ValueError(f"nproc must be an integer >= 1, got {value!r}")
    return nproc


def launch_command(recipe: Recipe, overrides: list[str], *, nproc: int, port: int, backend: str) -> list[str]:
    """The launcher's command that starts ``nproc`` ranks of ``odb train`` on this machine, each given
    the recipe's file and ``overrides`` (the backend's launcher: its ``local_launch``)."""
    from odb.training import backends

    return backends.get(backend).local_launch(RANK_MODULE, ["train", str(recipe.path), *overrides], nproc=nproc,
                                              port=port)


def main(argv: list[str] | None = None, prog: str = "odb train") -> int:
    from odb.training.launch.flags import SETTINGS_FILES, FileDefaults, check_inputs
    from odb.training.launch.flags import parser as run_parser

    args = parser(prog).parse_intermixed_args(argv)
    defaults = FileDefaults.bundled()
    try:
        recipe = load_recipe(args.recipe, folder=defaults.recipes, overrides=args.overrides)
        if under_launcher(os.environ):
            from odb.training.launch.main import main as run_rank

            run_rank([], defaults=defaults, recipe=recipe)  # (ends the process)
        flags = run_parser(defaults)
        words, _ = recipe.arguments(flags, settings_files=SETTINGS_FILES)
        flags.prog = prog
        backend = flags.parse_args(words).backend  # (a value a flag cannot take: argparse's error, exit 2)
        nproc = _nproc(recipe, args.nproc)
        if nproc > 1:  # the run's inputs checked here, before the launcher and its ranks' imports
            check_inputs([], defaults=defaults, recipe=recipe)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        sys.exit(f"{prog}: {err}")
    if nproc == 1:  # one rank: this process, as python launch/train.py alone
        from odb.training.launch.main import main as run_rank

        run_rank([], defaults=defaults, recipe=recipe)
    from odb.training.config.environment import free_port

    command = launch_command(recipe, args.overrides, nproc=nproc, port=args.master_port or free_port(),
                             backend=backend)
    print(f"{prog}: {nproc} ranks of {recipe.path} on this machine: {' '.join(command)}", flush=True)
    sys.stderr.flush()
    os.execv(command[0], command)  # the launcher in this process's place: its exit code and signals
    return 0  # (not reached)
