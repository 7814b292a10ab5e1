"""The DeepSpeed backend (``deepspeed launch/train.py``, the default): ZeRO 0-3 over a transformers model.

DeepSpeed's JSON stays DeepSpeed's (:mod:`odb.training.ds_config`); the model is built in its
precision and, at ZeRO-3, partitioned as it is constructed (:func:`odb.training.model.build_model`);
checkpoints are DeepSpeed's own, resumable on another number of ranks through its universal
checkpoint (:mod:`odb.training.reshard`). :class:`DeepSpeedBackend` is what
:class:`odb.training.engine.OdbEngine` drives (:class:`odb.training.engine.Backend`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from odb.training.config import OptimizationSettings
from odb.training.engine import torch_optimizer
from odb.training.export import gather_state_dict

__all__ = ["DeepSpeedBackend", "deepspeed_shm_buffer", "init_deepspeed_distributed", "initialize_deepspeed",
           "release_shared_memory"]


def init_deepspeed_distributed(timeout_s: float) -> None:
    """Joins the process group as DeepSpeed does (NCCL on GPUs, gloo on CPUs). Under torchrun's agent
    store (``torchrun --max-restarts``), odb forms the group first, through this restart attempt's
    keys (:func:`odb.training.faults.process_group_kwargs`: torch's own keys outlive an attempt), and
    DeepSpeed takes it as it is."""
    import deepspeed

    from odb.training.faults import init_process_group, uses_agent_store

    if uses_agent_store():
        init_process_group(timeout_s)
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))


def initialize_deepspeed(opt: OptimizationSettings, model):
    """``deepspeed.initialize`` (collective) with a torch optimizer, unless DeepSpeed's JSON declares one."""
    import deepspeed

    ds_config = dict(opt.deepspeed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None
    if "optimizer" not in ds_config:  # a torch optimizer: no DeepSpeed op to compile
        optimizer = torch_optimizer(opt.optimizer, params, lr=opt.lr, weight_decay=opt.weight_decay)
        if opt.optimizer == "sgd":
            ds_config.setdefault("zero_allow_untested_optimizer", True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=ds_config)
    return engine


def deepspeed_shm_buffer(rank: int) -> Path:
    """The shared-memory file DeepSpeed's CPU all-reduce makes for ``rank`` when every rank is on
    one machine (``LOCAL_SIZE`` = world size), named after the user, the master address and port."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
    return Path("/dev/shm") / f"{name}_{os.environ.get('MASTER_PORT', '')}_{rank}"


def release_shared_memory() -> None:
    """Removes this rank's DeepSpeed all-reduce buffer, which DeepSpeed never removes: each CPU run
    would otherwise leave 64 MiB of RAM per rank in ``/dev/shm`` until the machine restarts (330
    runs filled a 24 GiB machine). Every peer mapped it at initialization, so removing the name
    leaves their mappings intact. No-op where there is none (GPUs, several machines)."""
    if "RANK" in os.environ:
        deepspeed_shm_buffer(int(os.environ["RANK"])).unlink(missing_ok=True)


class DeepSpeedBackend:
    """A DeepSpeed engine as odb's :class:`~odb.training.engine.Backend`.

    Args:
        engine: what ``deepspeed.initialize`` returned (:func:`initialize_deepspeed`).
    """

    name = "deepspeed"

    def __init__(self, engine) -> None:
        self.engine = engine
        self.module = engine.module
        self.device = engine.device

    def __call__(self, **batch: Any) -> Any:
        return self.engine(**batch)

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        # the boundary decides DeepSpeed's reduction; it stays set once set, so it is set every time
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, scale_wrt_gas=False)  # odb's loss is already scaled for the step

    def step(self) -> None:
        self.engine.step()

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def release_cache(self) -> None:
        # ZeRO-3 keeps parameters a forward gathered for reuse (up to stage3_max_live_parameters)
        # until a backward releases them
        self.engine.empty_partition_cache()

    def save(self, folder: Path, tag: str) -> None:
        self.engine.save_checkpoint(str(folder), tag=tag)  # (writes ``folder / 'latest'`` too)

    def load(self, folder: Path, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(str(folder), tag=tag)
        if path is None:
            raise FileNotFoundError(f"--resume: no DeepSpeed checkpoint {folder / tag}")

    def full_state_dict(self, *, dtype: torch.dtype | None, trainable_only: bool) -> dict[str, torch.Tensor] | None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        dtype = dtype or next(self.module.parameters()).dtype
        optimizer = getattr(self.engine, "optimizer", None)
        if hasattr(optimizer, "checkpoint_event_prologue"):  # ZeRO-3: every parameter partitioned first
            optimizer.checkpoint_event_prologue()
        keep = (lambda _, p: p.requires_grad) if trainable_only else None
        state_dict = gather_state_dict(self.module, dtype=dtype, rank=rank, keep=keep)
        if hasattr(optimizer, "checkpoint_event_epilogue"):
            optimizer.checkpoint_event_epilogue()
        return state_dict
