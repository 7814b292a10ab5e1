"""Before any rank waits on another: what this rank will run, checked.

:func:`check_startup` runs in ``launch/train.py`` after the flags are parsed and before the process
group (``Trainer.init``). It stops the rank with :class:`StartupError`, naming what to install, when

* torch is older than :data:`TORCH_FLOOR` (setup.py's floor, which says why);
* the chosen backend needs torch APIs this install lacks (its module's ``TORCH_NEEDS``);
* the model mixes tokens other than by attention (a state-space, linear-attention or short-convolution
  layer), so packed samples would leak into each other: :func:`odb.training.model.capability.packing_refusal`,
  on the model's skeleton (its config on the ``meta`` device, no weights read);
* ranks span nodes under ``torchrun --max-restarts`` (each node's agent counts its own restarts, so
  the ranks of one attempt would disagree on its store keys: :func:`check_restarts`);
* odb's packed attention cannot run on this rank's device in the run's precision:
  :func:`odb.training.attention.attention_path` probes it once (on CUDA: one tiny packed call, checked)
  and names it; the start banner shows that name (:func:`probed_attention`).

A failed check is local to the rank and early: no rank is left waiting for it in a collective.

The waits that follow announce themselves (:mod:`odb.training.run.waits`).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from odb.training import backends
from odb.training.config.settings import RunConfig

__all__ = ["StartupError", "TORCH_FLOOR", "check_packing", "check_restarts", "check_sequence_parallel",
           "check_startup", "check_torch", "probed_attention", "rank_device", "run_dtype", "torch_version"]

TORCH_FLOOR = (2, 6)
"""The oldest torch odb supports (setup.py states the same, with the reasons)."""


class StartupError(RuntimeError):
    """This rank cannot run the configuration; the message names the fix."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch's), e.g. ``'2.6.0+cu124'`` -> (2, 6)."""
    major, minor, *_ = (version or torch.__version__).split("+")[0].split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _resolve(dotted: str):
    """The module or attribute ``dotted`` names (``a.b.C``), or None where it does not exist."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name, None)
            if found is None:
                return None
        return found
    return None


def _has(owner, name: str) -> bool:
    fields = getattr(owner, "__dataclass_fields__", None)  # (a dataclass's fields without defaults are no attributes)
    return hasattr(owner, name) or (fields is not None and name in fields)


def check_torch(backend: str) -> None:
    """Raises :class:`StartupError` naming the torch to install when this one is older than
    :data:`TORCH_FLOOR` or lacks what ``backend`` uses (its module's ``TORCH_NEEDS``)."""
    floor = ".".join(map(str, TORCH_FLOOR))
    if torch_version() < TORCH_FLOOR:
        raise StartupError(f"odb needs torch >= {floor} (transformers 5.2x refuses older torch; FSDP2's fully_shard "
                           f"is public from 2.6), found {torch.__version__}: pip install 'torch>={floor}' (the build "
                           "for your CUDA, https://pytorch.org/get-started/locally)")
    if not torch.distributed.is_available():
        raise StartupError(f"this torch build ({torch.__version__}) has no torch.distributed: install a standard "
                           "torch build (pip install torch)")
    chosen = backends.get(backend)
    missing = [f"{owner}.{name}" for owner, names in chosen.TORCH_NEEDS
               for name in names if (found := _resolve(owner)) is None or not _has(found, name)]
    if missing:
        others = " or ".join(f"--backend {name}" for name in backends.NAMES if name != backend)
        raise StartupError(f"--backend {backend} needs {', '.join(missing)}, which torch {torch.__version__} lacks: "
                           f"pip install 'torch>={chosen.TORCH_FLOOR}', or train with {others}")


def rank_device() -> torch.device:
    """The device this rank will train on: its GPU (``LOCAL_RANK``) where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_dtype(config: RunConfig) -> torch.dtype:
    """The precision the model computes in, as the run's backend sets it."""
    return backends.get(config.optimization.backend).compute_dtype(config.optimization)


@lru_cache(maxsize=4)
def _attention_path(device: torch.device, dtype: torch.dtype) -> str:
    from odb.training import attention

    return attention.attention_path(device, dtype)


def probed_attention(config: RunConfig) -> str:
    """The packed attention path this rank runs (probed once, by :func:`check_startup`), for the banner.

    Raises:
        StartupError: the path cannot run; the message names the torch or flash-attn to install.
    """
    device, dtype = rank_device(), run_dtype(config)
    try:
        return "odb_varlen: " + _attention_path(device, dtype)
    except RuntimeError as error:
        raise StartupError(f"packed attention cannot run on {device} in {str(dtype).removeprefix('torch.')}: "
                           f"{error}") from error


def check_packing(config: RunConfig, model=None) -> None:
    """Raises :class:`StartupError` where odb cannot pack the run's model exactly (the reason names its
    layers): :func:`odb.training.model.capability.packing_refusal` on the model's skeleton (``model``, or
    built here)."""
    from odb.training.model.capability import packing_refusal, skeleton

    refusal = packing_refusal(model if model is not None else skeleton(config.model.path))
    if refusal is not None:
        raise StartupError(refusal)


def check_sequence_parallel(config: RunConfig, model, env=os.environ) -> None:
    """Raises :class:`StartupError` where ``--sequence_parallel_size`` cannot run: a size that does not
    divide the launch's ranks (``WORLD_SIZE``) or the model's heads, or a vision model
    (:func:`odb.training.step.sequence_parallel.check_model`, on the skeleton ``model``): before the
    weights load, not after. The same for over_cap 'sequence_parallel''s groups."""
    from odb.training.step.sequence_parallel import check_model, long_sample_degrees

    size = config.model.sequence_parallel_size
    world = int(env.get("WORLD_SIZE", "1"))
    if config.batching.over_cap == "sequence_parallel":  # (per micro-batch)
        if size > 1:
            raise StartupError("--over_cap sequence_parallel shares long samples between ranks per micro-batch, and "
                               "--sequence_parallel_size splits every row: use one of them")
        try:
            long_sample_degrees(model, config.batching.max_sp, world)
        except ValueError as error:
            raise StartupError(str(error)) from None
    if size == 1:
        return
    if world % size:
        raise StartupError(f"--sequence_parallel_size {size} must divide the {world} ranks of this launch "
                           f"(groups of {size} consecutive ranks); launch a multiple of {size} ranks, or another size")
    try:
        check_model(model, size)
    except ValueError as error:
        raise StartupError(str(error)) from None


def check_restarts(env=os.environ) -> None:
    """Raises :class:`StartupError` for ``torchrun --max-restarts N`` (N > 0) over several nodes.

    odb keys its store entries by restart attempt (:func:`odb.training.backends.process_group.attempt_prefix`, from
    ``TORCHELASTIC_RESTART_COUNT``), but each node's agent counts only its own workers' failures: after
    one node's worker fails, that node starts attempt 1 while the others start attempt 0 again
    (measured here with two agents: ``odb/restart1`` on one node, ``odb/restart0`` on the other), and
    no rendezvous forms. One node, or a scheduler's requeue (a new job, a new store), has no such
    disagreement."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if restarts > 0 and local < world:
        raise StartupError(f"torchrun --max-restarts {restarts} over several nodes ({world} ranks, {local} here): "
                           "each node's agent counts its own restarts, so the ranks of a restarted attempt would "
                           "disagree on which attempt it is; run multi-node jobs with --max-restarts 0 and let the "
                           "scheduler requeue them (sbatch --requeue with launch/slurm.sbatch, which resumes), or "
                           "use --max-restarts on one node only")


def check_startup(config: RunConfig) -> str:
    """Every check above, before any process group; returns the attention path (the banner's words).

    Raises:
        StartupError: naming the fix.
    """
    from odb.training.model.capability import skeleton

    check_torch(config.optimization.backend)
    check_restarts()
    model = skeleton(config.model.path)
    check_packing(config, model)
    check_sequence_parallel(config, model)
    return probed_attention(config)
