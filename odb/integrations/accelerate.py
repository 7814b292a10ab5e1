"""odb in an Accelerate loop of one's own: :func:`odb_run` gives the steps, :func:`backward` runs
one micro-batch with the step's accumulation boundary.

    accelerator = Accelerator()                           # DDP, DeepSpeed or FSDP, as configured
    model, optimizer = accelerator.prepare(model, optimizer)
    run = odb_run(accelerator, model, settings, lr=2e-5, output_dir="runs/x")
    for step in run.steps():                              # every rank the same number, same length
        set_lr(optimizer, step.lr)                        # odb's rate by progress
        for micro in step.micro_batches:                  # dummies too: real zero-weight passes
            backward(accelerator, model, micro)           # reduces over the ranks at the last only
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step.end()                                        # odb records it (metrics, audit)
    run.finish()                                          # summary.json, collective
    run.close()

Checkpoints: ``accelerator.save_state(folder)`` and ``run.save_states(folder)`` after a step; to
resume, ``accelerator.load_state(folder)`` and ``run.load_states(folder)`` before the first.
Leave the Accelerator's ``gradient_accumulation_steps`` at 1: the accumulation is odb's ``gas``
(``settings.batching.gas``), and odb's loss is already scaled for the whole step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from odb.integrations.core import HostMicro, HostRun, OdbSettings, host_config
from odb.training.attention.varlen import register

__all__ = ["backward", "odb_run", "set_lr"]


def _kind(accelerator) -> str:
    return getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))


def _is_deepspeed(accelerator) -> bool:
    return _kind(accelerator) == "DEEPSPEED"


def odb_run(accelerator, model: torch.nn.Module, settings: OdbSettings, *, lr: float, output_dir: str | Path,
            epochs: int = 1, warmup_ratio: float = 0.03, weight_decay: float = 0.0,
            model_path: str | None = None, resuming: bool = False) -> HostRun:
    """odb's side of this rank's run over ``model`` as ``accelerator.prepare`` returned it
    (collective: every rank). ``lr``, ``warmup_ratio``: odb's schedule by progress (linear warmup,
    cosine to a tenth), which :attr:`HostStep.lr` gives each step; ``weight_decay`` is recorded
    only (the optimizer is yours). ``resuming``: :meth:`HostRun.load_states` follows (an output
    folder that holds odb's files is refused otherwise)."""
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}): "
                         "odb accumulates over its gas (OdbSettings.batching.gas) with the loss scaled for the whole "
                         "step; leave the Accelerator's at 1")
    module = accelerator.unwrap_model(model)
    module.set_attn_implementation(register())  # packed rows: each sample attends to itself only (as OdbTrainer)
    path = model_path or getattr(module.config, "_name_or_path", "") or "host model"
    deepspeed = accelerator.state.deepspeed_plugin.deepspeed_config if _is_deepspeed(accelerator) else None
    fsdp = _kind(accelerator) == "FSDP"
    config = host_config(settings, model_path=path, output_dir=output_dir, lr=lr, warmup_ratio=warmup_ratio,
                         weight_decay=weight_decay, epochs=epochs, gas=settings.batching.gas,
                         backend="fsdp2" if fsdp else "deepspeed", backend_settings=None if fsdp else deepspeed)
    run = HostRun(config, module, device=accelerator.device, resuming=resuming)
    run.host.call = model
    return run


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every param group of ``optimizer`` at ``lr`` (odb's rate for the step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def backward(accelerator, model: torch.nn.Module, micro: HostMicro) -> torch.Tensor:
    """Forward, loss and backward of ``micro``, reducing the gradients over the ranks only in the
    step's last micro-batch (DDP's ``no_sync`` before it; DeepSpeed's accumulation boundary).
    Returns the loss backed (detached)."""
    accelerator.gradient_state._set_sync_gradients(micro.is_last)  # (as HF Trainer sets it per micro-batch)
    deepspeed = _is_deepspeed(accelerator)
    quiet: Any = contextlib.nullcontext() if micro.is_last or deepspeed else accelerator.no_sync(model)
    with quiet:
        loss = micro.loss()
        if deepspeed:
            accelerator.backward(loss, scale_wrt_gas=False)
        else:
            accelerator.backward(loss)
    return loss.detach()
