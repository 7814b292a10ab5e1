"""The ``odb`` command (installed by the package): ``odb train`` from a recipe, and the user-facing
tools as subcommands. Each subcommand imports what it needs when it runs, so ``odb --help`` is quick.

    odb train demo --nproc 2 max_samples=100 output_dir=runs/try
    odb export runs/try/checkpoints runs/try/hf
"""

from __future__ import annotations

import importlib
import sys

from odb.settings import nearest

__all__ = ["COMMANDS", "main"]

COMMANDS = {  # name: (module, function, what it does)
    "train": ("odb.cli.train", "main", "train from a recipe (a YAML file or a bundled recipe's name) on this "
                                       "machine's ranks, or as one rank under a launcher or SLURM"),
    "recipes": ("odb.cli.files", "recipes", "list the bundled recipes, or print one to copy and edit"),
    "export": ("odb.cli.export", "main", "a saved checkpoint as a Hugging Face model folder"),
    "show-labels": ("odb.cli.show_labels", "main", "what a run would train on: records processed, label runs "
                                                   "decoded"),
    "check-model": ("odb.cli.check_model", "main", "odb's packed micro-batches against the model run one sample at "
                                                   "a time (logits, loss, gradients)"),
    "plot": ("odb.cli.plot", "main", "runs' metrics.jsonl plotted: tokens/s, padding, rank balance, loss (PNG)"),
    "path": ("odb.cli.files", "path", "where a bundled file is (launch/slurm.sbatch, configs/...), or their folder"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: odb COMMAND [ARGS ...]   (odb COMMAND --help: its arguments)", "",
             "odb: online dynamic batching for DeepSpeed / FSDP2 fine-tuning", "", "commands:"]
    lines += [f"  {name:{width}}  {what}" for name, (_, _, what) in COMMANDS.items()]
    lines += ["", "the recipe format: docs/recipes.md; every key: docs/settings.md (odb's repository)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs ``odb COMMAND ...``; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [word for word in argv if not word.startswith("--local_rank=")]  # (DeepSpeed's runner adds it; the
    # rank reads LOCAL_RANK from the environment)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        near = nearest(name, COMMANDS)
        hint = f"; did you mean {near!r}?" if near else ""
        print(f"odb: no command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), function)(rest, prog=f"odb {name}") or 0
