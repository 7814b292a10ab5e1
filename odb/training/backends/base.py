"""What a training backend is to odb: the step loop's door (:class:`Backend`, a built backend) and a
backend module's door (:class:`BackendModule`, what ``odb/training/backends/<name>.py`` provides
from settings to clean-up). :class:`LocalBackend` is the one-process backend of checks and tests."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from odb.training.config.optimization import OptimizationSettings
    from odb.training.config.settings import RunConfig

__all__ = ["Backend", "BackendModule", "CheckpointLoad", "LocalBackend", "optimizer_kept_fresh", "torch_optimizer"]


def torch_optimizer(name: str, params: list[torch.nn.Parameter], *, lr: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """The run's torch optimizer (``--optimizer``: 'adamw' or 'sgd') over ``params``, either backend's."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr)


def optimizer_kept_fresh(optimizer: Any, counters: Sequence[tuple[Any, str]] = ()
                         ) -> contextlib.AbstractContextManager[None]:
    """What runs inside leaves ``optimizer`` as it was: every torch optimizer it holds (itself, or
    DeepSpeed's wrapper's ``.optimizer``, and so on) gets its state and param groups back (torch's
    optimizers make their state at their first step: then it is simply cleared; one that made it at
    construction, Adagrad, gets a CPU copy of it back), and each ``(object, attribute)`` of
    ``counters`` (a wrapper's step counts, a loss scaler's) its value."""
    return _kept_fresh(optimizer, counters)


@contextlib.contextmanager
def _kept_fresh(optimizer: Any, counters: Sequence[tuple[Any, str]]) -> Iterator[None]:
    optimizers, seen = [], optimizer
    while seen is not None and all(seen is not o for o in optimizers):
        if isinstance(seen, torch.optim.Optimizer):
            optimizers.append(seen)
        seen = getattr(seen, "optimizer", None)
    if not optimizers:
        raise TypeError(f"no torch optimizer in {type(optimizer).__name__}: the preflight cannot reset its state "
                        "(run with --preflight off)")
    saved = [_cpu_copy(opt.state_dict()) for opt in optimizers]
    values = [copy.deepcopy(getattr(owner, name)) for owner, name in counters]
    try:
        yield
    finally:
        for opt, state in zip(optimizers, saved, strict=True):
            opt.state.clear()  # (load_state_dict keeps what the saved state does not name)
            opt.load_state_dict(state)
        for (owner, name), value in zip(counters, values, strict=True):
            setattr(owner, name, value)


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return copy.deepcopy(value)


class Backend(Protocol):
    """What odb's step loop, evaluation and checkpoints use of a training backend; nothing else
    knows which backend runs. Every method that talks to the other ranks is collective: every
    rank calls it, in the same order."""

    name: str
    """'deepspeed' or 'fsdp2'."""
    module: torch.nn.Module
    """The model as trained (a PEFT model under LoRA), for its config, its head and its mode."""
    device: torch.device

    def __call__(self, **batch: Any) -> Any:
        """The model's forward through the backend (collective: parameter gathers)."""

    def set_lr(self, lr: float) -> None: ...

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        """Accumulates ``grad(loss)``; ``sync``: this is the step's last backward, whose gradients
        are reduced over the ranks (collective)."""

    def step(self) -> None:
        """One optimizer step on the accumulated gradients (clipped as configured), which it then
        clears (collective)."""

    def train(self, mode: bool = True) -> None: ...

    def pristine(self) -> contextlib.AbstractContextManager[None]:
        """Steps taken inside leave the optimizer as built (state, step counts): the preflight's
        (:mod:`odb.training.run.preflight`), before the first real step."""

    def release_cache(self) -> None:
        """Frees what forwards without a backward (evaluation) left gathered."""

    def save(self, folder: Path, tag: str) -> None:
        """The model's and optimizer's state in ``folder / tag``, and ``folder / 'latest'`` naming
        ``tag`` (collective)."""

    def load(self, folder: Path, tag: str) -> None:
        """Loads :meth:`save`'s state (collective); ``FileNotFoundError`` if there is none."""

    def full_state_dict(self, *, dtype: torch.dtype | None, trainable_only: bool) -> dict[str, torch.Tensor] | None:
        """The model's full weights as CPU tensors on rank 0, None elsewhere (collective), named as
        ``module.state_dict()`` names them; ``dtype`` None: the training precision."""


class LocalBackend:
    """A :class:`Backend` on one process, for checks and tests (check-model, the unit tests): the
    model's call (its last output kept as ``last``, its batch as ``last_batch``), backward into
    ``.grad``, and no optimizer step, so the gradients stay for the caller to read; no checkpoints."""

    name = "local"

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None) -> None:
        self.module, self.device = model, device or torch.device("cpu")
        self.last: Any = None
        self.last_batch: dict[str, Any] = {}

    def __call__(self, **batch: Any) -> Any:
        self.last_batch, self.last = batch, self.module(**batch)
        return self.last

    def set_lr(self, lr: float) -> None:
        pass

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @contextlib.contextmanager
    def pristine(self) -> Iterator[None]:
        """No optimizer here; the gradients the steps inside left are dropped."""
        try:
            yield
        finally:
            for param in self.module.parameters():
                param.grad = None

    def release_cache(self) -> None:
        pass



class CheckpointLoad(Protocol):
    """Where a built backend loads a checkpoint from (:meth:`BackendModule.plan_load`)."""

    folder: Path
    """What :meth:`Backend.load` takes as its folder."""
    tag: str
    """What :meth:`Backend.load` takes as its tag."""


class BackendModule(Protocol):
    """What each backend module provides (``odb.training.backends.get(name)``). Collective functions
    are called by every rank, in the same order."""

    NAME: str
    """Its ``--backend`` name, also the :class:`~odb.training.config.optimization.OptimizationSettings` field
    holding its resolved settings."""
    TITLE: str
    """Its name in messages ("DeepSpeed")."""
    JOINING: str
    """What joining its process group waits on besides the other ranks ('' for nothing more)."""
    TORCH_NEEDS: tuple[tuple[str, tuple[str, ...]], ...]
    """What it uses of torch: module or class paths and the names each must have (checked at start)."""
    TORCH_FLOOR: str
    """The torch release that has all of :data:`TORCH_NEEDS`."""

    def load_settings(self, path: str | Path | Mapping[str, Any] | None, *, gas: int, world_size: int,
                      use_bf16: bool) -> Any:
        """Its settings from the file ``path`` (JSON or YAML), or its contents given inline by a recipe
        (:class:`odb.settings.Inline`; None: its built-in defaults), resolved for this run."""

    def local_launch(self, module: str, args: list[str], *, nproc: int, port: int) -> list[str]:
        """The command that starts ``nproc`` ranks of ``python -m module args`` on this machine, with
        its launcher (``odb train``; a rendezvous on ``port``)."""

    def init_distributed(self, timeout_s: float) -> None:
        """Joins the process group (collective)."""

    def build(self, config: RunConfig, *, rank: int, vocab_size: int, load: CheckpointLoad | None = None
              ) -> Backend:
        """The model, its optimizer and collectives, ready for ``load`` where resuming (collective)."""

    def plan_load(self, config: RunConfig, folder: Path, tag: str, *, rank: int, world_size: int) -> CheckpointLoad:
        """How to load ``folder / tag`` on ``world_size`` ranks, made ready (collective: a conversion)."""

    def compute_dtype(self, optimization: OptimizationSettings) -> torch.dtype:
        """The precision the model computes in."""

    def describe(self, optimization: OptimizationSettings) -> dict[str, Any]:
        """The start banner's and W&B's summary of its settings."""

    def shared_settings(self, optimization: OptimizationSettings) -> dict[str, Any]:
        """Its settings every rank must share (checked in the batcher's first collective)."""

    def set_gas(self, optimization: OptimizationSettings, backend: Backend, gas: int) -> OptimizationSettings:
        """Its settings, and ``backend`` built from them, with odb's gas now ``gas`` (derived from
        ``global_batch_tokens`` after the build); its settings as they then are."""

    def holds_checkpoint(self, tag_folder: Path) -> bool:
        """Whether ``tag_folder`` holds this backend's checkpoint files."""

    def incomplete_files(self, tag_folder: Path) -> list[str]:
        """Its files of the checkpoint in ``tag_folder`` that a save killed part-way left missing or
        cut short, each with what is wrong (``"fsdp2/.metadata missing"``); [] when every rank's are whole."""

    def consolidated_state_dict(self, tag_folder: Path, *, run: Mapping[str, Any], model_path: str | Path,
                                exclude_frozen: bool) -> dict[str, torch.Tensor]:
        """A saved checkpoint's full weights in one process, no process group (an export)."""

    def saved_dtype(self, optimization: Mapping[str, Any]) -> torch.dtype:
        """The training precision of a saved run (its ``run_config.json``'s ``optimization``)."""

    def release(self) -> None:
        """Local clean-up at the end, on every path (error-safe; not collective)."""
