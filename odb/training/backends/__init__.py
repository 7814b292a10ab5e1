"""Training backends: one module per backend, each owning its whole life.

    deepspeed.py          DeepSpeed ZeRO 0-3 (``deepspeed launch/train.py``, the default)
    deepspeed_config.py   DeepSpeed's JSON: read strictly, "auto" filled in, contradictions refused
    zero3.py              ZeRO-3: the model partitioned as it is constructed
    universal.py          DeepSpeed's universal checkpoints: a resume on another number of ranks
    fsdp2.py              PyTorch FSDP2 (``torchrun launch/train.py --backend fsdp2``)
    ulysses.py            DeepSpeed's Ulysses attention for sequence parallelism, under either backend
    process_group.py      joining the process group and the rendezvous store, for every backend
    base.py               the interfaces (Backend, BackendModule) and a one-process backend for checks

Whatever differs between backends lives in the backend's module, behind the functions
:class:`~odb.training.backends.base.BackendModule` lists: reading its settings file, joining the
process group, building the model (ZeRO-3 partitioned as it is constructed, FSDP2 on ``meta``),
the step (:class:`~odb.training.backends.base.Backend`), save/load, planning a resume on another
world size, gathering full weights for an export, and cleaning up. The rest of odb asks
:func:`get` for the run's backend and never names one, nor imports ``deepspeed`` or FSDP2's APIs
(``tests/unit/test_layers.py`` checks). A third backend is one new module here, named in
:data:`NAMES` (and its settings field in :class:`odb.training.config.optimization.OptimizationSettings`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from odb.training.backends.base import Backend, BackendModule, LocalBackend, torch_optimizer
from odb.training.config.optimization import BACKENDS as NAMES

__all__ = ["NAMES", "Backend", "BackendModule", "LocalBackend", "for_checkpoint", "get", "torch_optimizer"]


def get(name: str) -> BackendModule:
    """The module of backend ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"--backend must be one of {NAMES}, got {name!r}")
    return importlib.import_module(f"odb.training.backends.{name}")  # type: ignore[return-value]


def for_checkpoint(tag_folder: Path) -> BackendModule | None:
    """The backend whose files ``tag_folder`` (``OUTPUT_DIR/checkpoints/<tag>``) holds, or None."""
    return next((get(name) for name in NAMES if get(name).holds_checkpoint(tag_folder)), None)
