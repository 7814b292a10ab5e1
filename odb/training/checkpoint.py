"""Checkpoints: DeepSpeed's (model, optimizer) plus odb's own files, one tag folder per save.

``OUTPUT_DIR/checkpoints/<tag>/`` holds, besides DeepSpeed's files (through
:meth:`odb.training.engine.OdbEngine.save`):

* ``odb_state.rank<R>.json``: the rank's batcher state (its window, planned steps, stream
  position), from which a fresh batcher reproduces the rest of the plan exactly;
* ``run_state.rank<R>.json``: the run's progress and the rank's whole-run counts
  (:meth:`odb.telemetry.Telemetry.state_dict`), so that a resumed run's summary covers the run;
* ``run_config.json``: the resolved config of the run that saved it (rank 0).

Saving and loading are collective (DeepSpeed's part is): every rank, the same tag.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from odb.training.build import Components
from odb.training.config import RunConfig

__all__ = ["load_checkpoint", "save_checkpoint"]


def _folder(config: RunConfig) -> Path:
    return config.output_dir / "checkpoints"


def save_checkpoint(parts: Components, config: RunConfig, tag: str) -> None:
    """Saves the run as ``tag`` (collective); with ``--save_total_limit N``, then removes all but
    the newest N ``step<k>`` checkpoints (rank 0, once every rank has written ``tag``)."""
    import torch.distributed as dist

    folder = _folder(config)
    parts.engine.save(folder, tag)
    rank = parts.rank
    (folder / tag / f"odb_state.rank{rank}.json").write_text(json.dumps(parts.batcher.state_dict()))
    (folder / tag / f"run_state.rank{rank}.json").write_text(
        json.dumps(parts.telemetry.state_dict(parts.feed.skipped, parts.feed.truncated)))
    if rank == 0:
        (folder / tag / "run_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    limit = config.checkpoints.save_total_limit
    if limit is not None:
        dist.barrier()  # every rank's files of ``tag`` are written before older tags go
        if rank == 0:
            for old in _step_tags(folder)[:-limit]:
                if old != tag:
                    shutil.rmtree(folder / old)


def _step_tags(folder: Path) -> list[str]:
    """The ``step<k>`` checkpoint folders, oldest (lowest k) first."""
    tags = [p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"step\d+", p.name)]
    return sorted(tags, key=lambda name: int(name[4:]))


def load_checkpoint(parts: Components, config: RunConfig, tag: str, log: Callable[[str], None]) -> None:
    """Continues the run from ``tag`` ('latest': the last saved) (collective); ``log``: rank 0's console.

    Raises:
        FileNotFoundError: no such checkpoint.
        ValueError: the checkpoint's run already trained every epoch of ``--epochs``.
    """
    folder = _folder(config)
    tag = (folder / "latest").read_text().strip() if tag == "latest" else tag
    parts.engine.load(folder, tag)
    state = json.loads((folder / tag / f"odb_state.rank{parts.rank}.json").read_text())
    epochs = config.run.epochs
    if state["is_done"] and state["config"]["mode"] == "join" and state["epoch"] >= epochs:
        raise ValueError(f"--resume: the run in {config.output_dir} already trained all {state['epoch']} "
                         f"epoch(s); pass --epochs > {state['epoch']} to train more, or start a new "
                         "--output_dir")
    parts.batcher.load_state_dict(state)
    parts.feed.restore(parts.batcher.held_uids())
    parts.telemetry.load_state_dict(json.loads((folder / tag / f"run_state.rank{parts.rank}.json").read_text()))
    extended = f" (extended to --epochs {epochs})" if state["is_done"] else ""
    log(f"resumed from {folder / tag}: {parts.telemetry.samples_done} samples done{extended}")
