"""The DeepSpeed backend (``deepspeed launch/train.py``, the default): ZeRO 0-3 over a transformers model.

Settings: DeepSpeed's JSON stays DeepSpeed's (``--deepspeed_config``). odb packs each micro-batch
into one row, so DeepSpeed sees ``train_micro_batch_size_per_gpu = 1``, ``gradient_accumulation_steps
= GAS`` (odb's) and ``train_batch_size = GAS * world`` packed rows per step; the samples in them vary
from step to step. ``"auto"`` resolves to those; a fixed value that disagrees is an error naming the
fix, raised before any process group is joined.

Build: the model is built in DeepSpeed's training precision (:func:`training_dtype`) and, at ZeRO-3,
partitioned while it is constructed (``deepspeed.zero.Init``): a rank holds its partition and, for
a moment, one module whole, never the whole model. A folder loads through transformers' DeepSpeed
integration (rank 0 memory-maps the checkpoint and fills each module's parameters, gathered, then
partitioned again; the other ranks read only the shapes); a random init draws exactly the numbers
a plain ``from_config`` draws (:mod:`odb.training.backends.zero3`), so a seed gives the same weights at
every ZeRO stage and on one process.

Checkpoints are DeepSpeed's own, resumable on another number of ranks through its universal
checkpoint (:mod:`odb.training.backends.universal`); an export gathers full weights module by
module (:func:`gather_state_dict`) or, from a saved checkpoint, with DeepSpeed's ``zero_to_fp32``.
:class:`DeepSpeedBackend` is what :class:`odb.training.step.engine.OdbEngine` drives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from odb.settings import ConfigSource, source_name
from odb.training.backends.base import optimizer_kept_fresh, torch_optimizer
from odb.training.backends.deepspeed_config import (
    is_zero3,
    load_ds_config,
    resolve_ds_config,
    training_dtype,
    zero_stage_of,
)
from odb.training.backends.universal import LoadPlan, incomplete_files, prepare_load
from odb.training.backends.zero3 import Zero3Construction
from odb.training.model.build import build_model as build_hf_model

if TYPE_CHECKING:
    from odb.training.config.optimization import OptimizationSettings
    from odb.training.config.settings import RunConfig

__all__ = ["DeepSpeedBackend", "NAME", "build", "build_model", "deepspeed_shm_buffer", "gather_state_dict",
           "incomplete_files", "init_distributed", "initialize_deepspeed", "local_launch", "release"]

NAME = "deepspeed"


TITLE = "DeepSpeed"


JOINING = "DeepSpeed's communication op (built once per extension cache), then "


TORCH_NEEDS: tuple[tuple[str, tuple[str, ...]], ...] = ()


TORCH_FLOOR = "2.6"


# ---- settings -------------------------------------------------------------------------------------

def load_settings(path: ConfigSource | None, *, gas: int, world_size: int, use_bf16: bool) -> dict[str, Any]:
    """DeepSpeed's JSON (or YAML) ``path``, or a recipe's inline mapping, resolved (:func:`resolve_ds_config`)."""
    source = source_name(path)
    return resolve_ds_config(load_ds_config(path), gas=gas, world_size=world_size, use_bf16=use_bf16,
                             source=source)


def compute_dtype(optimization: OptimizationSettings) -> torch.dtype:
    return training_dtype(optimization.deepspeed)


def saved_dtype(optimization: Mapping[str, Any]) -> torch.dtype:
    return training_dtype(optimization["deepspeed"])


def describe(optimization: OptimizationSettings) -> dict[str, Any]:
    ds = optimization.deepspeed
    return {"backend": NAME, "zero_stage": zero_stage_of(ds), "bf16": ds.get("bf16", {}).get("enabled", False)}


def shared_settings(optimization: OptimizationSettings) -> dict[str, Any]:
    ds = optimization.deepspeed
    zero = ds.get("zero_optimization", {})
    return {
        "deepspeed.gradient_accumulation_steps": ds.get("gradient_accumulation_steps"),
        "deepspeed.train_micro_batch_size_per_gpu": ds.get("train_micro_batch_size_per_gpu"),
        "deepspeed.zero_stage": zero.get("stage", 0),
        "deepspeed.offload": [zero.get(f"offload_{what}", {}).get("device") for what in ("optimizer", "param")],
        "deepspeed.precision": {k: ds.get(k, {}).get("enabled", False) for k in ("bf16", "fp16")},
        "deepspeed.gradient_clipping": ds.get("gradient_clipping"),
        "deepspeed.optimizer": ds.get("optimizer"),
    }


def set_gas(optimization: OptimizationSettings, backend: Any, gas: int) -> OptimizationSettings:
    """DeepSpeed's ``gradient_accumulation_steps`` / ``train_batch_size`` for odb's ``gas``, in its
    config and its engine's (``set_train_batch_size``; the JSON it saves with each checkpoint)."""
    ds = dict(optimization.deepspeed)
    ranks = ds["train_batch_size"] // ds["gradient_accumulation_steps"]  # (micro-batches of 1 row a rank)
    ds.update(gradient_accumulation_steps=gas, train_batch_size=gas * ranks)
    engine = backend.engine  # (a DeepSpeedBackend)
    batch = gas * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
    engine.set_train_batch_size(batch)
    if isinstance(engine.config, dict):
        engine.config.update(gradient_accumulation_steps=gas, train_batch_size=batch)
    return dataclasses.replace(optimization, deepspeed=ds)


# ---- process group, build ---------------------------------------------------------------------------

def local_launch(module: str, args: list[str], *, nproc: int, port: int) -> list[str]:
    """The command that starts ``nproc`` ranks of ``python -m module args`` on this machine (``odb
    train``): DeepSpeed's runner, as ``deepspeed --num_gpus N``; each rank reads its LOCAL_RANK from
    the environment, so the runner adds no ``--local_rank`` argument."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(port),
            "--no_local_rank", "--module", module, *args]


def init_distributed(timeout_s: float) -> None:
    """Joins the process group as DeepSpeed does (NCCL on GPUs, gloo on CPUs). Under torchrun's agent
    store (``torchrun --max-restarts``), odb forms the group first, through this restart attempt's
    keys (:func:`odb.training.backends.process_group.process_group_kwargs`: torch's own keys outlive an attempt), and
    DeepSpeed takes it as it is."""
    import deepspeed

    from odb.training.backends.process_group import init_process_group, uses_agent_store

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


def release() -> None:
    """Removes this rank's DeepSpeed all-reduce buffer, which DeepSpeed never removes: each CPU run
    would otherwise leave 64 MiB of RAM per rank in ``/dev/shm`` until the machine restarts (330
    runs filled a 24 GiB machine). Every peer mapped it at initialization, so removing the name
    leaves their mappings intact. No-op where there is none (GPUs, several machines)."""
    if "RANK" in os.environ:
        deepspeed_shm_buffer(int(os.environ["RANK"])).unlink(missing_ok=True)


def build_model(path: str | Path, *, seed: int, vocab_size: int, ds_config: Mapping[str, Any] | None,
                lora: Mapping[str, Any] | None = None, gradient_checkpointing: bool = False, score_head: bool = False):
    """:func:`odb.training.model.build.build_model` in DeepSpeed's precision and, at ZeRO-3, partitioned as
    it is constructed (collective at ZeRO-3: every rank, after the process group is joined)."""
    return build_hf_model(path, seed=seed, vocab_size=vocab_size, lora=lora, score_head=score_head,
                          gradient_checkpointing=gradient_checkpointing, dtype=training_dtype(ds_config),
                          construction=Zero3Construction(ds_config) if is_zero3(ds_config) else None)


def build(config: RunConfig, *, rank: int, vocab_size: int, load: LoadPlan | None = None) -> DeepSpeedBackend:
    """The model built in DeepSpeed's precision (at ZeRO-3 partitioned as it is built), then
    ``deepspeed.initialize`` (collective); ``load``: a resume's plan, whose DeepSpeed config the
    engine is built with (a universal checkpoint's)."""
    optimization = config.optimization
    if load is not None:
        optimization = dataclasses.replace(optimization, deepspeed=load.ds_config)
    model_settings = config.model
    model = build_model(model_settings.path, seed=config.seed, vocab_size=vocab_size,
                        lora=dict(model_settings.lora) if model_settings.lora is not None else None,
                        ds_config=optimization.deepspeed, gradient_checkpointing=model_settings.gradient_checkpointing,
                        score_head=config.objective.scores)
    return DeepSpeedBackend(initialize_deepspeed(optimization, model))


def plan_load(config: RunConfig, folder: Path, tag: str, *, rank: int, world_size: int) -> LoadPlan:
    """:func:`odb.training.backends.universal.prepare_load` (collective: a conversion when the world
    size changed)."""
    return prepare_load(folder, tag, rank=rank, world_size=world_size, ds_config=config.optimization.deepspeed)


class DeepSpeedBackend:
    """A DeepSpeed engine as odb's :class:`~odb.training.backends.base.Backend`.

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

    @contextlib.contextmanager
    def pristine(self) -> Iterator[None]:
        """The torch optimizer inside DeepSpeed's as built, the engine's step counts, loss scaler
        (fp16) and its link from each parameter to its optimizer state as they were: ZeRO-1/2 and
        the bf16 optimizer link them at their first step, once (``_hp_optimizer_states_linked``),
        so the run's first step links the state it makes, and the probe's is freed now."""
        engine, optimizer = self.engine, self.engine.optimizer
        counters = [(engine, name) for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
                    if hasattr(engine, name)]
        scaler = getattr(optimizer, "loss_scaler", None)
        if scaler is not None:
            counters += [(scaler, name) for name in vars(scaler)]
        if hasattr(optimizer, "_hp_optimizer_states_linked"):
            counters.append((optimizer, "_hp_optimizer_states_linked"))
        with optimizer_kept_fresh(optimizer, counters):
            try:
                yield
            finally:
                for param in self.module.parameters():
                    mapping = getattr(param, "_hp_mapping", None)
                    if mapping is not None and hasattr(mapping, "optim_fragment"):
                        mapping.optim_fragment = None  # (views of the probe's state)

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


# ---- export -----------------------------------------------------------------------------------------

def gather_state_dict(module: torch.nn.Module, *, dtype: torch.dtype, rank: int,
                      keep: Callable[[str, torch.nn.Parameter], bool] | None = None) -> dict[str, torch.Tensor] | None:
    """The full weights of ``module`` as CPU copies in ``dtype`` on rank 0 (None elsewhere); collective.

    Under ZeRO-3 the parameters are partitioned: each module's own parameters are gathered with
    ``deepspeed.zero.GatheredParameters`` (read-only, ``modifier_rank=None``: repartitioned on exit,
    nothing broadcast back), copied to the CPU on rank 0, and released before the next module. So
    rank 0 holds one full copy (in ``dtype``) plus one module's gathered parameters, the other ranks
    only the latter. At ZeRO 0-2 the parameters are whole on every rank and the context is a no-op.
    Shared parameters (tied embeddings) are gathered once and appear under each of their names, one
    tensor. Persistent buffers are copied too. The live parameters are never written to.

    Args:
        module: ``engine.module``: the HF model or a PEFT model wrapping it.
        dtype: of the floating-point copies.
        rank: this process's rank (rank 0 keeps the copies).
        keep: which parameters to include (by name and parameter; the same answer on every rank),
            e.g. the trainable ones for an adapter; default all, and then the buffers too.
    """
    import deepspeed

    state_dict: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    seen: dict[tuple[str, int], str] = {}  # parameter identity -> the first name it was copied under

    def visit(mod: torch.nn.Module, prefix: str) -> None:
        named = [(prefix + n, p) for n, p in mod.named_parameters(recurse=False)
                 if keep is None or keep(prefix + n, p)]
        fresh = [p for _, p in named if _identity(p) not in seen]
        with deepspeed.zero.GatheredParameters(fresh, modifier_rank=None) if fresh else nullcontext():
            for key, param in named:
                first = seen.setdefault(_identity(param), key)
                if state_dict is not None:
                    state_dict[key] = state_dict[first] if first != key else _cpu_copy(param, dtype)
            if state_dict is not None and keep is None:
                for name, buf in mod.named_buffers(recurse=False):
                    if name not in mod._non_persistent_buffers_set:
                        state_dict[prefix + name] = _cpu_copy(buf, dtype)
        for name, child in mod.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return state_dict


def _identity(param: torch.nn.Parameter) -> tuple[str, int]:
    return ("ds_id", param.ds_id) if hasattr(param, "ds_id") else ("id", id(param))


def _cpu_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a copy even on the CPU: the writer merges LoRA into it in place, and ZeRO-3 frees what it gathered
    return tensor.detach().to("cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype, copy=True)


def holds_checkpoint(tag_folder: Path) -> bool:
    return any(tag_folder.glob("*_optim_states.pt")) or (tag_folder / "mp_rank_00_model_states.pt").is_file()


def consolidated_state_dict(tag_folder: Path, *, run: Mapping[str, Any], model_path: str | Path,
                            exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """fp32 master weights from ZeRO 1-3's optimizer partitions (``zero_to_fp32``; ``exclude_frozen``:
    only the trained ones); at ZeRO-0 the module's own (``mp_rank_00``, in the training precision)."""
    if any(tag_folder.glob("*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(tag_folder.parent), tag=tag_folder.name,
                                                        exclude_frozen_parameters=exclude_frozen)
    states = tag_folder / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise FileNotFoundError(f"{tag_folder} has no DeepSpeed model states (mp_rank_00_model_states.pt or "
                                "*_optim_states.pt): the save did not finish; export another tag")
    # mmap: the optimizer states in the same file stay on disk
    return dict(torch.load(states, map_location="cpu", mmap=True, weights_only=False)["module"])
