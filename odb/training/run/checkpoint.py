"""Checkpoints: the backend's (model, optimizer) plus odb's own files, one tag folder per save.

``OUTPUT_DIR/checkpoints/<tag>/`` holds, besides the backend's files (through
:meth:`odb.training.step.engine.OdbEngine.save`: DeepSpeed's own, or FSDP2's
``torch.distributed.checkpoint`` folder ``fsdp2/``):

* ``odb_state.rank<R>.json``: the rank's batcher state (its window, planned steps, stream
  position), from which a fresh batcher reproduces the rest of the plan exactly;
* ``run_state.rank<R>.json``: the run's progress and the rank's whole-run counts
  (:meth:`odb.telemetry.Telemetry.state_dict`), so that a resumed run's summary covers the run;
* ``run_config.json``: the resolved config of the run that saved it (rank 0).

Saving and loading are collective (the backend's part is): every rank, the same tag. A checkpoint
resumes under the backend that saved it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from odb.batching.config import AUTO
from odb.batching.redeal import redeal_states
from odb.batching.state import is_finished, upgrade_state
from odb.telemetry import Telemetry
from odb.telemetry.writer import SUPERSEDED
from odb.training import backends
from odb.training.backends.base import CheckpointLoad
from odb.training.config.settings import RunConfig
from odb.training.run.assemble import Components

__all__ = ["FINISHED", "checkpoint_states", "load_checkpoint", "load_plan", "mark_finished", "missing_parts",
           "resolve_tag", "restore_states", "save_checkpoint", "sorted_tags", "write_states"]

FINISHED = "finished"
"""A file in a checkpoint's tag folder: the run that saved it went on to finish there (evaluation,
export, summary). A checkpoint of every step without it (a stop at the last step, a failure in
the end) resumes into the end of the run instead of being refused."""


def _folder(config: RunConfig) -> Path:
    return config.output_dir / "checkpoints"


def save_checkpoint(parts: Components, config: RunConfig, tag: str) -> None:
    """Saves the run as ``tag`` (collective); with ``--save_total_limit N``, then removes all but
    the newest N ``step<k>`` checkpoints (rank 0, once every rank has written ``tag``)."""
    import torch.distributed as dist

    folder = _folder(config)
    rank = parts.rank
    # odb's files first: the backend's save ends by naming the tag in 'latest' (after every rank's
    # part), so 'latest' never names a tag whose odb files a killed save did not write
    (folder / tag).mkdir(parents=True, exist_ok=True)
    (folder / tag / FINISHED).unlink(missing_ok=True)
    write_states(parts, folder / tag)
    if rank == 0:
        (folder / tag / "run_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    parts.engine.save(folder, tag)
    limit = config.checkpoints.save_total_limit
    if limit is not None:
        dist.barrier()  # every rank's files of ``tag`` are written before older tags go
        if rank == 0:
            for old in _step_tags(folder)[:-limit]:
                if old != tag:
                    shutil.rmtree(folder / old)


def write_states(parts: Components, folder: Path) -> None:
    """This rank's odb files of a checkpoint into ``folder``: its batcher state and its run state,
    named by its data-parallel rank (a sequence-parallel group's ranks hold the same: one writes)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not parts.writes_data_files:
        return
    (folder / f"odb_state.rank{parts.data_rank}.json").write_text(json.dumps(parts.batcher.state_dict()))
    (folder / f"run_state.rank{parts.data_rank}.json").write_text(
        json.dumps(parts.telemetry.state_dict(parts.feed.skipped, parts.feed.truncated)))


def restore_states(parts: Components, state: dict, run_state: dict) -> None:
    """Puts this rank's batcher, feed and run totals where :func:`write_states`'s files left them
    (``state`` and ``run_state`` as :func:`checkpoint_states` reads them)."""
    parts.batcher.load_state_dict(state)
    held = parts.batcher.held_uids()
    parts.feed.restore(held)
    # (a resume on fewer ranks under over_cap 'sequence_parallel': the data layer now cuts long
    # samples at the smaller groups' reach, by turns; the batcher plans them as processed now)
    parts.batcher.remeasure({uid: parts.feed.sizes_of(uid) for uid in held})
    parts.telemetry.load_state_dict(run_state)


def mark_finished(config: RunConfig, tag: str) -> None:
    """Marks checkpoint ``tag`` as the end of a finished run (:data:`FINISHED`; rank 0, once the
    summary is written)."""
    (_folder(config) / tag / FINISHED).write_text("the run finished here: summary.json written\n")


def _step_tags(folder: Path) -> list[str]:
    """The ``step<k>`` checkpoint folders, oldest (lowest k) first."""
    tags = [p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"step\d+", p.name)]
    return sorted(tags, key=lambda name: int(name[4:]))


def resolve_tag(config: RunConfig, tag: str) -> str:
    """``--resume``'s tag: 'latest' is the last one saved. Raises ``FileNotFoundError`` naming the
    tags there are when there is no such checkpoint."""
    folder = _folder(config)
    if tag == "latest":
        latest = folder / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"--resume: {folder} has no 'latest' file (no checkpoint finished saving); "
                                    f"pass --resume TAG with one of {_tags(folder)}")
        tag = latest.read_text().strip()
    if not (folder / tag).is_dir():
        raise FileNotFoundError(f"--resume: no checkpoint {folder / tag}; the tags there are {_tags(folder)}")
    return tag


def load_plan(config: RunConfig, tag: str, *, rank: int, world_size: int) -> CheckpointLoad:
    """How the backend loads checkpoint ``tag`` (:func:`resolve_tag`'s) on ``world_size`` ranks, before
    the engine is built (the backend's ``plan_load``, collective: DeepSpeed converts to a universal
    checkpoint when the world size changed; FSDP2's loads on any number of ranks as it is). Raises
    ``ValueError`` for a checkpoint of another backend."""
    folder = _folder(config)
    backend = config.optimization.backend
    saved_config = folder / tag / "run_config.json"
    saved = _read_json(saved_config, "run config").get("optimization", {}).get("backend", "deepspeed") \
        if saved_config.is_file() else backend
    if saved != backend:
        raise ValueError(f"--resume: {folder / tag} was saved by --backend {saved}, this run is --backend {backend}; "
                         f"resume it with --backend {saved}, or start a new --output_dir")
    return backends.get(backend).plan_load(config, folder, tag, rank=rank, world_size=world_size)


def saved_budgets(config: RunConfig, tag: str, log: Callable[[str], None]) -> RunConfig:
    """``config`` with its ``max_tokens`` / ``max_patches`` 'auto' replaced by the budgets the
    checkpoint's run resolved at its start (its ``run_config.json``): a resumed run plans as the run
    it continues, whatever a new search would measure (the preflight still checks that the budget
    fits here)."""
    auto = [name for name in ("max_tokens", "max_patches") if getattr(config.batching, name) == AUTO]
    if not auto:
        return config
    path = _folder(config) / tag / "run_config.json"
    batching = _read_json(path, "run config").get("batching", {})
    saved = {name: batching.get(name) for name in auto}

    def resolved(name: str, value) -> bool:  # (max_patches may be null: no cap)
        return isinstance(value, int) and not isinstance(value, bool) or value is None and name == "max_patches"

    if not all(resolved(name, value) for name, value in saved.items()):
        raise ValueError(f"--resume: {path} has no resolved {' / '.join(auto)} ({saved}); resume with the budgets "
                         "the run trained with (--max_tokens N)")
    log(f"odb: {', '.join(f'{k} auto: {v}, as the checkpoint resolved it' for k, v in saved.items())}")
    return dataclasses.replace(config, batching=dataclasses.replace(config.batching, **saved))


def _tags(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):  # (none, or rank 0 removing it right now)
        return []


def _read_json(path: Path, what: str) -> dict:
    """A JSON object odb wrote into a checkpoint, or an error that says what is wrong with it."""
    fix = f"resume from another tag of {path.parent.parent} (--resume TAG), or start a new --output_dir"
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {path} is missing: the checkpoint was not written completely (a run "
                                f"stopped while saving?) or is not odb's; {fix}")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--resume: {path} is truncated or not JSON ({err}); {fix}") from err
    if not isinstance(value, dict) or "version" not in value and what == "batcher state":
        raise ValueError(f"--resume: {path} is not an odb {what}; {fix}")
    return value


def missing_parts(tag_folder: Path) -> list[str]:
    """What checkpoint ``tag_folder`` lacks to be resumed, each named with what is wrong
    (``"odb_state.rank1.json missing"``); [] when it is complete, as a save killed part-way never
    leaves it: every file a resume reads is there whole. odb's own, as :func:`load_plan` and
    :func:`checkpoint_states` read them (``run_config.json``, and the batcher and run states of
    every rank of the world size ``odb_state.rank0.json`` names, each a JSON object of odb's), then
    the backend's (its ``incomplete_files``; the backend the run config names, else the one whose
    files are there)."""
    gaps: list[str] = []

    def whole(name: str, what: str) -> dict | None:
        try:
            return _read_json(tag_folder / name, what)
        except FileNotFoundError:
            gaps.append(f"{name} missing")
        except ValueError:
            gaps.append(f"{name} cut short or not odb's")
        return None

    config = whole("run_config.json", "run config")
    first = whole("odb_state.rank0.json", "batcher state")
    world = first.get("world_size") if first is not None else None
    if first is not None and not (isinstance(world, int) and world >= 1):
        gaps.append("odb_state.rank0.json names no world size")
    for rank in range(world if isinstance(world, int) else 0):
        if rank:
            whole(f"odb_state.rank{rank}.json", "batcher state")
        whole(f"run_state.rank{rank}.json", "run state")
    saved_by = config.get("optimization", {}).get("backend", "deepspeed") if config is not None else None
    backend = backends.get(saved_by) if saved_by in backends.NAMES else backends.for_checkpoint(tag_folder)
    if backend is None:
        return [*gaps, f"no checkpoint files of {' or '.join(backends.NAMES)}"]
    return [*gaps, *backend.incomplete_files(tag_folder)]


def sorted_tags(folder: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The checkpoint tags in ``folder`` (``OUTPUT_DIR/checkpoints``), oldest first (by the step of a
    ``step<k>`` tag; a tag of another name before them): the complete ones, and the others with
    what each lacks (:func:`missing_parts`)."""
    def age(name: str) -> tuple[int, str]:
        return (int(name[4:]) if re.fullmatch(r"step\d+", name) else -1, name)

    complete, incomplete = [], {}
    for tag in sorted(_tags(folder), key=age):
        gaps = missing_parts(folder / tag)
        if gaps:
            incomplete[tag] = gaps
        else:
            complete.append(tag)
    return complete, incomplete


def checkpoint_states(folder: Path, *, rank: int, world_size: int) -> tuple[dict, dict, int]:
    """This rank's batcher state and run state from checkpoint ``folder``, and the world size that
    saved it; from a checkpoint of another world size, re-dealt to this one
    (:func:`odb.batching.redeal.redeal_states`)."""
    saved = _read_json(folder / "odb_state.rank0.json", "batcher state").get("world_size")
    if not isinstance(saved, int) or saved < 1:
        raise ValueError(f"--resume: {folder / 'odb_state.rank0.json'} has no valid world_size: not odb's")
    if saved == world_size:
        return (_read_json(folder / f"odb_state.rank{rank}.json", "batcher state"),
                _read_json(folder / f"run_state.rank{rank}.json", "run state"), saved)
    states = [_read_json(folder / f"odb_state.rank{r}.json", "batcher state") for r in range(saved)]
    runs = [_read_json(folder / f"run_state.rank{r}.json", "run state") for r in range(saved)]
    return redeal_states(states, world_size)[rank], Telemetry.redeal_states(runs, world_size)[rank], saved


def load_checkpoint(parts: Components, config: RunConfig, tag: str, plan: CheckpointLoad, log: Callable[[str], None]
                    ) -> None:
    """Continues the run from checkpoint ``tag`` (:func:`resolve_tag`'s), whose model and optimizer
    ``plan`` loads (:func:`load_plan`'s: the engine was built for it)
    (collective); ``log``: rank 0's console. A checkpoint of another
    number of ranks is re-dealt to this one: odb's states here, the model's by DeepSpeed's universal
    checkpoint.

    Raises:
        FileNotFoundError: no such checkpoint, or one that was not written completely.
        ValueError: the checkpoint's run already trained every epoch of ``--epochs``; a file of it is
            truncated or not odb's; DeepSpeed could not load it.
    """
    folder = _folder(config)
    state, run_state, saved_world = checkpoint_states(folder / tag, rank=parts.data_rank, world_size=parts.data_world)
    state, epochs = upgrade_state(state), config.run.epochs
    is_join = state["config"]["mode"] == "join"
    # Finished: every step planned AND trained. A checkpoint from inside the last round (its steps
    # still queued: --save_steps, a preemption) is not finished; it resumes those steps. One of every
    # step whose run did not finish there (a stop at its last step, a failure in its end) resumes
    # into the end: evaluation, final checkpoint, export, summary.
    trained_all = is_join and is_finished(state) and state["epoch"] >= epochs
    if trained_all and (folder / tag / FINISHED).is_file():
        raise ValueError(f"--resume: the run in {config.output_dir} already trained all {state['epoch']} "
                         f"epoch(s) and finished; pass --epochs > {state['epoch']} to train more, or start a new "
                         "--output_dir")
    try:
        parts.engine.load(plan.folder, plan.tag)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as err:  # noqa: BLE001 - the backend's own errors come from deep inside: say what to do
        raise ValueError(f"--resume: {parts.engine.backend.name} could not load {folder / tag} ({type(err).__name__}: "
                         f"{err}); the checkpoint is incomplete, or was saved with another model, LoRA or ZeRO config; "
                         f"resume from another tag ({_tags(folder)}) with the settings that saved it") from err
    restore_states(parts, state, run_state)
    extended = f" (extended to --epochs {epochs})" if is_join and state["is_planned"] and state["epoch"] < epochs \
        else ""
    ranks = "data-parallel ranks" if parts.sequence_parallel else "ranks"  # (sequence parallelism: groups)
    moved = f", saved by {saved_world} {ranks}, its untrained samples dealt to {parts.data_world}" \
        if saved_world != parts.data_world else ""
    ending = "; every step is trained: finishing the run (evaluation, checkpoint, export, summary)" \
        if trained_all else ""
    log(f"resumed from {folder / tag}: {parts.telemetry.samples_done} samples done{extended}{moved}{ending}")
    superseded = parts.telemetry.superseded  # (rank 0: rows of an earlier process past the checkpoint)
    if superseded is not None:
        torn = f", {superseded.torn} of them cut by a kill" if superseded.torn else ""
        steps = f" of steps {superseded.steps}" if superseded.steps else ""
        log(f"odb: metrics.jsonl: {superseded.rows} row(s){steps}{torn}, written after this checkpoint by an earlier "
            f"process, moved to {SUPERSEDED}: this process trains those steps again")
