"""The output folder's policy, before any process group: what ``--resume``, ``--resume auto`` and
``--overwrite_output_dir`` do with an earlier run there (:func:`resume_tag`), on every rank alike,
and the refusal to remove anything the run reads."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from odb.data.mixture import is_plain_path, parse_source, source_words

__all__ = ["DERIVED", "INCOMPLETE", "RUN_RECORDS", "earlier_run", "resume_tag"]

RUN_RECORDS = ("checkpoints/", "metrics.jsonl", "metrics.superseded.jsonl", "summary.json", "emitted_ids.rank*.jsonl",
               "hf/", "trackers.json", "tensorboard/", "mlruns/", "wandb/")
"""What a run writes into its ``--output_dir`` (its trackers' files too: ``--report_to``'s): an earlier
run's, removed by ``--overwrite_output_dir``, so that no tracker mixes the new run with it."""
DERIVED = ("reference_logps.npy", "reference_logps.json", "reference_logps.eval.npy", "reference_logps.eval.json")
"""What a run derives from its inputs and checks against them before it uses it again (``--reference
precompute``'s tables, :mod:`odb.training.run.reference`): removed by ``--overwrite_output_dir``, and
no earlier run by themselves: a second run in the folder, or a restarted attempt that saved no
checkpoint (``--resume auto`` starting over), loads a table made with the same settings instead of
making it again."""
INCOMPLETE = "incomplete_checkpoints"
"""Where ``--resume auto`` moves the checkpoint tags a save killed part-way left (no run reads them:
kept for you to look at or delete)."""


def earlier_run(folder: Path) -> list[Path]:
    """The records of an earlier run in ``folder`` (:data:`RUN_RECORDS`), [] if there are none. An
    empty ``checkpoints/`` folder holds no checkpoint and does not count."""
    found = []
    for pattern in RUN_RECORDS:
        for path in sorted(folder.glob(pattern.rstrip("/"))):
            if path.is_dir() and not _entries(path):
                continue
            found.append(path)
    return found


def _entries(folder: Path) -> list[str]:
    """The names in ``folder``, [] if it is not there (also when rank 0 is removing it right now)."""
    try:
        return sorted(p.name for p in folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def resume_tag(args: argparse.Namespace) -> str | None:
    """The checkpoint tag to resume (``--resume``; ``auto`` resolved), or None for a fresh run.

    The whole output-folder policy, the same on every rank (every rank reads the same folder, before
    any process group; the folder's state only changes when rank 0 moves an incomplete checkpoint
    aside, which every rank judges incomplete before and after, or removes an earlier run here, and
    then only what makes every rank start fresh anyway):

    * ``--resume [TAG]``: continue; the folder must hold checkpoints.
    * ``--resume auto``: 'latest' if the folder has it; else its newest complete checkpoint
      (:func:`~odb.training.run.checkpoint.missing_parts`: a save killed part-way left no 'latest'),
      the incomplete tags moved into :data:`INCOMPLETE`; else a fresh run, replacing an earlier run
      that saved no complete checkpoint and did not finish (a restarted attempt that failed before
      its first save finished), its incomplete tags moved aside too; a finished run
      (``summary.json`` or ``hf/``) is refused. Rank 0 says which in one line.
    * no ``--resume``: a folder that holds an earlier run (:func:`earlier_run`) is refused unless
      ``--overwrite_output_dir``, which removes it (rank 0), and the tables of :data:`DERIVED`
      (a table alone is no earlier run: it is kept and checked): no second run is appended to its
      metrics.jsonl, no old checkpoint or summary outlives it. In a restarted attempt of the same job
      (``torchrun --max-restarts``, a SLURM requeue) ``--overwrite_output_dir`` means ``--resume auto``:
      a restart continues the run the first attempt started, never removes it.
    * Nothing is removed that the run reads (``--model``, ``--tokenizer``, the data, the configs): a
      removal that would is refused.
    """
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} is a file; pass a folder (created if missing)")
    if args.overwrite_output_dir and _restart_attempt():
        print(f"odb: attempt {_restart_attempt()} of this job: --overwrite_output_dir read as --resume auto (a "
              "restart continues the run, it does not remove it)", flush=True)
        args.resume, args.overwrite_output_dir = "auto", False
    if args.resume and args.overwrite_output_dir:
        raise ValueError(f"--resume continues the run in --output_dir {out} and --overwrite_output_dir removes it: "
                         "pass one of them")
    checkpoints = out / "checkpoints"
    tags = _entries(checkpoints)
    incomplete: dict[str, list[str]] = {}
    if args.resume == "auto":
        if (checkpoints / "latest").is_file():
            return "latest"
        from odb.training.run.checkpoint import sorted_tags  # (parse_config has loaded torch by now)

        complete, incomplete = sorted_tags(checkpoints)
        if complete:
            moved = _set_aside(out, incomplete)
            _say(f"--resume auto: {checkpoints} has no 'latest' (a save that did not finish): resuming from "
                 f"{complete[-1]}, the newest complete checkpoint{moved}")
            return complete[-1]
    elif args.resume:
        if not tags:
            raise FileNotFoundError(f"--resume: no checkpoints in {checkpoints}; resume with the --output_dir of the "
                                    "run that saved them")
        return args.resume
    found = earlier_run(out)
    names = ", ".join(str(p.relative_to(out)) for p in found)
    if found and not (args.overwrite_output_dir or args.resume == "auto"):
        raise ValueError(f"--output_dir {out} holds an earlier run ({names}): pass --resume to continue it, "
                         "--overwrite_output_dir to start over (removes them), or another --output_dir")
    finished = [p.name for p in found if p.name in ("summary.json", "hf")]
    if args.resume == "auto" and finished:
        raise ValueError(f"--resume auto: --output_dir {out} holds a finished run ({', '.join(finished)}) and no "
                         f"{'complete ' if incomplete else ''}checkpoint to continue it from: pass "
                         "--overwrite_output_dir to replace it, or another --output_dir")
    derived = [out / name for name in DERIVED if (out / name).exists()] if args.overwrite_output_dir else []
    _check_not_an_input(args, found + derived)
    if found or derived:
        why = f"--resume auto: no complete checkpoint in {checkpoints}: " if incomplete else ""
        moved = _set_aside(out, incomplete)  # (first: what is moved aside is not removed)
        if _is_rank_0():
            gone = earlier_run(out) + derived
            _remove(gone)
            removed = f"; removed the earlier run's {', '.join(str(p.relative_to(out)) for p in gone)}" if gone else ""
            _say(f"{why}starting over in {out}{moved}{removed}")
    return None


def _is_rank_0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(line: str) -> None:
    """One line on rank 0's console (every rank decides alike)."""
    if _is_rank_0():
        print(f"odb: {line}", flush=True)


def _set_aside(out: Path, incomplete: dict[str, list[str]]) -> str:
    """Moves the ``incomplete`` checkpoint tags (what each lacks) into :data:`INCOMPLETE` (rank 0;
    the other ranks judge a tag being moved incomplete too): no later save of the same step writes
    into one, and nothing is deleted. Returns what it did, as the end of a line ('' for nothing)."""
    if not incomplete:
        return ""
    aside, moved = out / INCOMPLETE, []
    for tag, gaps in incomplete.items():
        target, n = aside / tag, 0
        while target.exists():  # (an earlier attempt's of the same step)
            n += 1
            target = aside / f"{tag}.{n}"
        if _is_rank_0():
            aside.mkdir(exist_ok=True)
            (out / "checkpoints" / tag).rename(target)
        more = f" and {len(gaps) - 1} more" if len(gaps) > 1 else ""
        moved.append(f"{tag} ({gaps[0]}{more}) to {target}")
    return f"; moved the incomplete {', '.join(moved)}"


def _restart_attempt() -> int:
    """Which restart of this job this process runs in: torchrun's ``--max-restarts`` count, else
    SLURM's requeue count (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) or int(os.environ.get("SLURM_RESTART_COUNT") or 0)


_INPUTS = ("model", "tokenizer", "data", "eval_data", "data_config", "odb_config", "deepspeed_config",
           "fsdp_config", "lora")


def _check_not_an_input(args: argparse.Namespace, removed: list[Path]) -> None:
    """Raises ``ValueError`` where a path the run reads lies in what would be removed (a second stage
    trained from the first stage's export in the same folder, say)."""
    gone = [p.resolve() for p in removed]
    for flag in _INPUTS:
        value = getattr(args, flag, None)
        if not value or not isinstance(value, (str, list)):
            continue
        words = source_words(value)  # (--data, --eval_data: one or more words)
        for word in words if is_plain_path(words) else [s.path for s in map(parse_source, words)]:
            path = Path(word).resolve()
            hit = next((g for g in gone if path == g or g in path.parents), None)
            if hit is not None:
                raise ValueError(f"--{flag} {word} lies in {hit}, which starting over in --output_dir "
                                 f"{args.output_dir} would remove: move it out of the folder, or pass another "
                                 "--output_dir")


def _remove(paths: list[Path]) -> None:
    """Removes an earlier run's records (rank 0, before any process group: no rank writes into the
    folder before rank 0 has joined it)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
