"""Resuming a DeepSpeed checkpoint on another number of ranks: the model and optimizer half.

DeepSpeed 0.19.8 loads a ZeRO checkpoint only at the data-parallel world size that saved it,
except through its *universal checkpoint*: ``deepspeed.checkpoint.ds_to_universal`` rewrites a tag
folder, once, into one folder per parameter (its full fp32 weight, Adam's ``exp_avg`` and
``exp_avg_sq``, and ``step``), and an engine that ``deepspeed.initialize`` built with
``"checkpoint": {"load_universal": true}`` cuts its own partition out of those at any world size.
Measured on 2 -> 3 and 3 -> 2 CPU ranks (gloo), torch AdamW, full fine-tuning and LoRA, fp32 (and
bf16 where noted): every fp32 weight, both Adam moments and Adam's step come back bit for bit, and
the next step lands where the uninterrupted run's did (fp32: to 1.2e-7, reduction order):

=========  ====================================================  ===========================
stage      another world size                                    as it is, without this
=========  ====================================================  ===========================
ZeRO-0     the checkpoint as it is: it holds the whole model     (works)
           and the whole optimizer state; no conversion (the
           converter needs ZeRO's optimizer files, and a
           universal load at stage 0 restores no weights and
           then fails). fp32 and bf16.
ZeRO-1/2   convert, then load universally (fp32 and bf16).       DeepSpeed refuses:
ZeRO-3     convert (the converter's stage-3 path), then load     ``ZeRORuntimeException``
           universally (fp32 and bf16).                          "... used a DP world size
                                                                 of 2 but the current world
                                                                 size is 3" (ZeRO-3 LoRA:
                                                                 a size-mismatch
                                                                 ``RuntimeError``)
=========  ====================================================  ===========================

LoRA works at every stage: frozen weights have no optimizer state, and a universal load leaves
them as the model was built (from ``--model``, as the saving run had them); the trained (adapter)
weights and their Adam state come from the checkpoint. A Hugging Face model carries no
``universal_checkpoint_info``, which the converter asserts at ZeRO-1/2: it is injected (the
converter's ``--inject_missing_state``), which is all a model without tensor or pipeline
parallelism needs. A change of ZeRO stage between save and resume is refused here (untested).

Where the conversion goes: ``<folder>/<tag>/universal/``, inside the tag, so that removing a tag
(``--save_total_limit``) removes its conversion too; DeepSpeed's loads, ``zero_to_fp32`` and the
converter's file lists read the tag folder's own files (the converter's ``DeepSpeedCheckpoint``
walks subfolders too, so a conversion never starts beside a half-written one). It is written under
``universal.partial`` and renamed when complete: a conversion that died half-way is redone, never
loaded. It takes about 1.3x the checkpoint's disk space (the tiny model: 62 MB beside 49 MB) and
2-3 s for the tiny model on one core. The converter runs in the calling process
(``num_extract_workers = num_merge_workers = 1``: no process pool forked from a rank that holds
a process group) and reads every rank's files: rank 0 must see the whole folder (a shared
filesystem across nodes).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["LoadPlan", "UNIVERSAL", "incomplete_files", "plan_load", "prepare_load", "saved_world_size",
           "saved_zero_stage", "to_universal", "universal_folder", "with_universal_load"]

UNIVERSAL = "universal"
"""The conversion's folder name inside the tag folder."""


@dataclass(frozen=True)
class LoadPlan:
    """Where and how the engine loads a checkpoint: ``engine.load_checkpoint(folder, tag=tag)``
    on an engine that ``deepspeed.initialize`` built from ``ds_config``."""

    folder: Path
    """The checkpoints folder as ``load_checkpoint`` takes it (the tag folder for a conversion)."""
    tag: str
    """The tag as ``load_checkpoint`` takes it (:data:`UNIVERSAL` for a conversion)."""
    ds_config: dict[str, Any]
    """DeepSpeed's config for ``deepspeed.initialize`` (with ``checkpoint.load_universal`` for a conversion)."""
    is_universal: bool


def _model_states_file(folder: Path, tag: str) -> Path:
    """The rank-0 model-states file of the checkpoint (ZeRO-3: one per rank; else one in all)."""
    tag_folder = Path(folder) / tag
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (tag_folder / name).is_file():
            return tag_folder / name
    raise FileNotFoundError(f"no DeepSpeed checkpoint in {tag_folder} (no *model_states.pt)")


def _saved(folder: Path, tag: str) -> tuple[int, int]:
    """``(data-parallel world size, ZeRO stage)`` that saved ``folder / tag``, from DeepSpeed's
    rank-0 model-states file (memory-mapped: the weights in it are not read)."""
    import torch

    states = torch.load(_model_states_file(folder, tag), map_location="cpu", weights_only=False, mmap=True)
    return int(states["dp_world_size"]), _zero_stage(states.get("ds_config") or {})


def incomplete_files(tag_folder: Path) -> list[str]:
    """DeepSpeed's files of the checkpoint in ``tag_folder`` that a save killed part-way left missing
    or cut short, each with what is wrong; [] when every rank wrote its files whole.

    DeepSpeed 0.19.8's save: rank 0 writes the model states (``mp_rank_00_model_states.pt``, with
    the number of ZeRO partitions, ``dp_world_size``, and the config); at ZeRO-3 each partition
    writes its own (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``); at ZeRO-1/2/3 each partition
    writes its optimizer state (``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, ``bf16_``
    under bf16), at ZeRO-0 only DeepSpeed's bf16 optimizer does (else the optimizer's state is in the
    model states). ``torch.save`` writes a zip archive whose directory comes last: a file cut short
    is no zip archive.
    """
    try:
        first = _model_states_file(tag_folder.parent, tag_folder.name)
    except FileNotFoundError:
        return ["mp_rank_00_model_states.pt (at ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt) missing"]
    if not _is_whole(first):
        return [f"{first.name} cut short"]
    import torch

    try:
        states = torch.load(first, map_location="cpu", weights_only=False, mmap=_is_zip(first))
        world, ds_config = int(states["dp_world_size"]), states.get("ds_config") or {}
    except Exception as err:  # noqa: BLE001 - whatever it is, this file cannot be resumed from
        return [f"{first.name} unreadable ({type(err).__name__})"]
    stage = _zero_stage(ds_config)
    bf16 = any((ds_config.get(key) or {}).get("enabled") is True for key in ("bf16", "bfloat16"))
    names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3 else []
    if stage > 0 or any(tag_folder.glob("*_optim_states.pt")):
        names += [f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    return [f"{name} {'cut short' if (tag_folder / name).exists() else 'missing'}" for name in names
            if not _is_whole(tag_folder / name)]


def _is_zip(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == b"PK\x03\x04"


def _is_whole(path: Path) -> bool:
    """Whether ``path`` is a file ``torch.save`` finished: a whole zip archive (its format since torch
    1.6; a file of the legacy format, which a config may ask for, only needs to be there)."""
    try:
        return zipfile.is_zipfile(path) if _is_zip(path) else path.stat().st_size > 0
    except OSError:  # (none, or moved away right now)
        return False


def saved_world_size(folder: str | Path, tag: str) -> int:
    """The data-parallel world size that saved ``folder / tag`` (DeepSpeed's ``dp_world_size``)."""
    return _saved(Path(folder), tag)[0]


def saved_zero_stage(folder: str | Path, tag: str) -> int:
    """The ZeRO stage that saved ``folder / tag`` (from the DeepSpeed config stored with it)."""
    return _saved(Path(folder), tag)[1]


def _zero_stage(ds_config: Mapping[str, Any]) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def universal_folder(folder: str | Path, tag: str) -> Path:
    """Where :func:`to_universal` writes the conversion of ``folder / tag``."""
    return Path(folder) / tag / UNIVERSAL


def to_universal(folder: str | Path, tag: str) -> Path:
    """Converts ``folder / tag`` (ZeRO-1/2/3) to DeepSpeed's universal checkpoint, once: returns
    :func:`universal_folder` at once if it is complete. One process only (rank 0), not collective.

    Raises:
        ValueError: a ZeRO-0 checkpoint (it needs no conversion: load it as it is).
    """
    from deepspeed.checkpoint import ds_to_universal

    folder = Path(folder)
    out = universal_folder(folder, tag)
    if (out / "zero" / "optimizer_state.pt").is_file():
        return out
    stage = saved_zero_stage(folder, tag)
    if stage == 0:
        raise ValueError(f"{folder / tag} is a ZeRO-0 checkpoint: it holds the whole model and optimizer "
                         "state and loads at any world size as it is; do not convert it")
    partial = out.with_name(UNIVERSAL + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a conversion that died half-way
    args = SimpleNamespace(input_folder=str(folder / tag), output_folder=str(partial), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)
    (folder / tag / "latest_universal").unlink(missing_ok=True)  # the converter's pointer to `partial`
    partial.rename(out)
    return out


def with_universal_load(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of DeepSpeed's ``ds_config`` with ``"checkpoint": {"load_universal": true}``: the
    engine ``deepspeed.initialize`` builds from it loads a universal checkpoint (DeepSpeed reads the
    key from the config it was initialized with; ``load_checkpoint`` has no argument for it).

    Raises:
        ValueError: a ZeRO-0 config (DeepSpeed would restore no weights, then fail).
    """
    if _zero_stage(ds_config) == 0:
        raise ValueError("a universal load at ZeRO-0 restores no weights (DeepSpeed 0.19.8 skips the module "
                         "and then fails); load a ZeRO-0 checkpoint as it is, at any world size")
    out = json.loads(json.dumps(ds_config))
    out["checkpoint"] = {**(out.get("checkpoint") or {}), "load_universal": True}
    return out


def plan_load(folder: str | Path, tag: str, *, world_size: int, ds_config: Mapping[str, Any]) -> LoadPlan:
    """How to load ``folder / tag`` at ``world_size`` under ``ds_config`` (not collective; reads files).

    The checkpoint as it is where the world size is the saving one or the stage 0; else its
    universal conversion (:func:`to_universal`, not run here: see :func:`prepare_load`).

    Raises:
        FileNotFoundError: no DeepSpeed checkpoint in ``folder / tag``.
        ValueError: the checkpoint was saved at another ZeRO stage.
    """
    folder = Path(folder)
    (saved, saved_stage), stage = _saved(folder, tag), _zero_stage(ds_config)
    if stage != saved_stage:
        raise ValueError(f"{folder / tag} was saved at ZeRO-{saved_stage}, this run is ZeRO-{stage}: resume "
                         f"with the ZeRO-{saved_stage} DeepSpeed config (--deepspeed_config)")
    if saved == world_size or stage == 0:
        return LoadPlan(folder=folder, tag=tag, ds_config=json.loads(json.dumps(ds_config)), is_universal=False)
    return LoadPlan(folder=folder / tag, tag=UNIVERSAL, ds_config=with_universal_load(ds_config), is_universal=True)


def prepare_load(folder: str | Path, tag: str, *, rank: int, world_size: int, ds_config: Mapping[str, Any],
                 timeout_s: float = 3600.0) -> LoadPlan:
    """:func:`plan_load`, with its conversion made by rank 0 while the others wait (collective: every
    rank, after the process group is joined and before ``deepspeed.initialize``, which must get the
    plan's ``ds_config``). Every rank raises what the conversion raised on rank 0.

    The others wait in a broadcast on a gloo group of its own (CPU: no accelerator device needs to
    be chosen yet), for up to ``timeout_s``, not the run's ``--dist_timeout_s``: a conversion reads
    and writes the whole checkpoint. Convert beforehand in one process
    (``python -m odb.training.backends.universal FOLDER TAG``) where that takes longer; this then finds it done.
    """
    import torch.distributed as dist

    plan = plan_load(folder, tag, world_size=world_size, ds_config=ds_config)
    if plan.is_universal:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        error = None
        if rank == 0:
            try:
                to_universal(folder, tag)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                error = exc
        failure = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(failure, src=0, group=group)
        dist.destroy_process_group(group)
        if failure[0] is not None:
            raise RuntimeError(f"converting {Path(folder) / tag} to a universal checkpoint failed on rank 0: "
                               f"{failure[0]}") from error
    return plan


def main(argv: list[str] | None = None) -> None:
    """``python -m odb.training.backends.universal FOLDER TAG``: converts ``FOLDER/TAG`` once, in this process."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", help="the checkpoints folder (OUTPUT_DIR/checkpoints)")
    parser.add_argument("tag", help="the checkpoint's tag (e.g. step20)")
    args = parser.parse_args(argv)
    print(f"universal checkpoint: {to_universal(args.folder, args.tag)}")


if __name__ == "__main__":
    main()
