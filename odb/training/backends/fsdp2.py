"""The FSDP2 backend (``torchrun launch/train.py --backend fsdp2``): PyTorch's ``fully_shard``, no DeepSpeed.

How the model comes to be sharded, without any rank holding it whole on its device:

1. every rank builds the model with its parameters on the ``meta`` device (shapes only, from the
   config; buffers such as the rotary frequencies are real), PEFT LoRA applied the same way;
2. each decoder layer and vision block (the model's ``_no_split_modules``) becomes an FSDP unit,
   then the root (embeddings, final norm, LM head, the vision tower's ends);
3. the shards are allocated on the rank's device (``to_empty``; the CPU under ``cpu_offload``)
   and filled from rank 0, which alone builds the model for real on its CPU (a folder's weights
   in their own precision, or the seeded random init in fp32, which draws what DeepSpeed's path
   draws) and broadcasts it tensor by tensor (``set_model_state_dict(broadcast_from_rank0=True)``;
   each rank keeps its shard, cast to fp32).

Training: parameters in fp32 shards (the optimizer's master weights); on a GPU with bf16, forward
and backward in bf16 with gradients reduced in fp32 (``MixedPrecisionPolicy``), as DeepSpeed's bf16
does; fp32 throughout on CPUs. Every micro-batch's forward all-gathers each unit's parameters and
its backward frees them. Gradients are reduce-scattered (averaged over the ranks) only in the
step's last backward (``set_requires_gradient_sync``): a step's micro-batches accumulate whole,
unreduced fp32 gradients on each rank (4 bytes per trained parameter; DeepSpeed's ZeRO-0/1 do the
same, ZeRO-2/3 reduce every micro-batch). ``reduce_every_micro_batch`` reduce-scatters after every
backward instead, accumulating into the shards: 1/W of that memory, GAS times the reductions,
the same gradient. Then clipping over the whole model (one all-reduce of the norm) and one
optimizer step. The loss math is the engine's
(:mod:`odb.training.step.engine`): the reduction averages over W, as DeepSpeed's does.

Checkpoints are ``torch.distributed.checkpoint`` folders (each rank writes its shards; under LoRA
only the trained weights and their optimizer state), loadable on any number of ranks: DCP reshards
on load. The Hugging Face export gathers full weights on rank 0 (``full_state_dict``), or, from a
saved checkpoint, puts its folder together in one process (:func:`consolidated_state_dict`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from odb.settings import ConfigSource, field_names, load_json_config
from odb.training.backends.base import optimizer_kept_fresh, torch_optimizer
from odb.training.config.objective import run_scores
from odb.training.config.optimization import Fsdp2Settings, OptimizationSettings
from odb.training.config.settings import ModelSettings
from odb.training.model.build import build_model, hf_model

if TYPE_CHECKING:
    from odb.training.config.settings import RunConfig

__all__ = ["DCP_FOLDER", "Fsdp2Backend", "NAME", "build", "build_fsdp2", "incomplete_files", "init_distributed",
           "load_settings", "local_launch", "param_dtype"]

NAME = "fsdp2"
TITLE = "FSDP2"
JOINING = ""
TORCH_NEEDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.distributed.fsdp", ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy",
                                "OffloadPolicy")),
    ("torch.distributed.fsdp.FSDPModule", ("set_requires_gradient_sync", "reshard")),
    ("torch.distributed.checkpoint.state_dict", ("StateDictOptions", "get_state_dict", "set_state_dict",
                                                 "get_model_state_dict", "set_model_state_dict")),
    ("torch.distributed.checkpoint.state_dict.StateDictOptions", ("full_state_dict", "cpu_offload",
                                                                  "ignore_frozen_params", "strict",
                                                                  "broadcast_from_rank0")),
    ("torch.distributed.checkpoint.format_utils", ("dcp_to_torch_save",)),
)
"""What this backend and its export use of torch: each a module or class and the names it must have.
All public in torch.distributed.fsdp since torch 2.6."""
TORCH_FLOOR = "2.6"

DCP_FOLDER = "fsdp2"
"""The ``torch.distributed.checkpoint`` folder inside a checkpoint's tag folder."""


def load_settings(path: ConfigSource | None, *, gas: int, world_size: int, use_bf16: bool) -> Fsdp2Settings:
    """FSDP2's settings from the JSON or YAML file ``path`` (or a recipe's inline mapping), strictly
    (None: the defaults), with
    ``mixed_precision: "auto"`` resolved (``use_bf16``: the GPU here has bf16)."""
    fix = "pass --fsdp_config configs/fsdp2.json"
    if isinstance(path, (str, Path)) and not str(path):
        raise FileNotFoundError(f"FSDP2 config: the path is empty; {fix}")
    values = {} if path is None else load_json_config(path, known=field_names(Fsdp2Settings), what="FSDP2 config",
                                                      fix=fix)
    settings = Fsdp2Settings(**values)
    if settings.mixed_precision == "auto":
        settings = dataclasses.replace(settings, mixed_precision="bf16" if use_bf16 else "fp32")
    return settings


def local_launch(module: str, args: list[str], *, nproc: int, port: int) -> list[str]:
    """The command that starts ``nproc`` ranks of ``python -m module args`` on this machine (``odb
    train``): torchrun, as ``torchrun --nproc_per_node N``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
            "-m", module, *args]


def init_distributed(timeout_s: float) -> None:
    """Joins the process group torchrun describes (:func:`odb.training.backends.process_group.init_process_group`)."""
    from odb.training.backends.process_group import init_process_group

    init_process_group(timeout_s)


def compute_dtype(optimization: OptimizationSettings) -> torch.dtype:
    return param_dtype(optimization.fsdp2)


def saved_dtype(optimization: Mapping[str, Any]) -> torch.dtype:
    return torch.bfloat16 if optimization["fsdp2"]["mixed_precision"] == "bf16" else torch.float32


def describe(optimization: OptimizationSettings) -> dict[str, Any]:
    return {"backend": NAME, "bf16": optimization.fsdp2.mixed_precision == "bf16",
            "cpu_offload": optimization.fsdp2.cpu_offload}


def shared_settings(optimization: OptimizationSettings) -> dict[str, Any]:
    return {"fsdp2": dataclasses.asdict(optimization.fsdp2)}


def set_gas(optimization: OptimizationSettings, backend: Any, gas: int) -> OptimizationSettings:
    return optimization  # (FSDP2 has no accumulation setting: odb's loop is all there is)


def release() -> None:
    pass


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """A DCP checkpoint loads on any number of ranks as it is (DCP reshards on load)."""

    folder: Path
    tag: str


def plan_load(config: RunConfig, folder: Path, tag: str, *, rank: int, world_size: int) -> LoadPlan:
    return LoadPlan(folder=folder, tag=tag)


def build(config: RunConfig, *, rank: int, vocab_size: int, load: LoadPlan | None = None) -> Fsdp2Backend:
    """:func:`build_fsdp2` with the run's settings (collective)."""
    return build_fsdp2(config.model, config.optimization, seed=config.seed, vocab_size=vocab_size, rank=rank,
                       score_head=config.objective.scores)


def holds_checkpoint(tag_folder: Path) -> bool:
    return (tag_folder / DCP_FOLDER / ".metadata").is_file()


def incomplete_files(tag_folder: Path) -> list[str]:
    """DCP writes its ``.metadata`` last, renamed into place once every rank's shards are written:
    without it the save did not finish."""
    return [] if holds_checkpoint(tag_folder) else [f"{DCP_FOLDER}/.metadata missing"]


def consolidated_state_dict(tag_folder: Path, *, run: Mapping[str, Any], model_path: str | Path,
                            exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """The fp32 shards of the checkpoint's ``torch.distributed.checkpoint`` folder put together. Under
    LoRA it holds the trained weights only: unless ``exclude_frozen``, the frozen ones are
    ``model_path``'s, as the run built them."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(tag_folder / DCP_FOLDER, Path(tmp) / "model.pt")
        state_dict = torch.load(Path(tmp) / "model.pt", map_location="cpu", weights_only=False)["model"]
    lora = run["model"]["lora"]
    if lora is not None and not exclude_frozen:
        base = build_model(model_path, seed=run["batching"]["seed"], vocab_size=0, lora=lora,
                           score_head=run_scores(run)).state_dict()
        state_dict = {**base, **state_dict}
    return state_dict


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def param_dtype(settings: Fsdp2Settings) -> torch.dtype:
    return torch.bfloat16 if settings.mixed_precision == "bf16" else torch.float32


def build_fsdp2(model_settings: ModelSettings, opt: OptimizationSettings, *, seed: int, vocab_size: int,
                rank: int, score_head: bool = False) -> Fsdp2Backend:
    """The sharded model and its optimizer (collective: every rank, after the process group).

    Args:
        model_settings: what to train (``--model``, ``--lora``, activation checkpointing).
        opt: the optimizer and the FSDP2 settings (``opt.fsdp2``).
        seed: the run's seed (random init and LoRA init, as the DeepSpeed path draws them).
        vocab_size: the tokenizer's.
        rank: this rank (rank 0 reads the weights and broadcasts them).
        score_head: a reward model (:func:`odb.training.model.build.build_model`).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    settings = opt.fsdp2
    assert settings is not None, "the FSDP2 settings are resolved by parse_config"
    lora = dict(model_settings.lora) if model_settings.lora is not None else None
    common = {"seed": seed, "vocab_size": vocab_size, "lora": lora, "score_head": score_head}
    model = build_model(model_settings.path, empty=True, gradient_checkpointing=model_settings.gradient_checkpointing,
                        **common)
    full = None
    if rank == 0:  # the weights, whole, on rank 0's CPU only: a folder's in its own precision
        full = build_model(model_settings.path, dtype="auto", **common).state_dict()
    device = _device()
    _shard(model, settings, device)
    buffers = dict(model.named_buffers())  # real: to_empty would replace them with uninitialized memory
    model.to_empty(device="cpu" if _offloaded(settings, device) else device)  # (offloaded shards live on the CPU)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)
    set_model_state_dict(model, full if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    dist.barrier()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch_optimizer(opt.optimizer, params, lr=opt.lr, weight_decay=opt.weight_decay)
    return Fsdp2Backend(model, optimizer, settings=settings, device=device, lora=lora is not None)


def _offloaded(settings: Fsdp2Settings, device: torch.device) -> bool:
    return settings.cpu_offload and device.type == "cuda"


def _shard(model: torch.nn.Module, settings: Fsdp2Settings, device: torch.device) -> None:
    """``fully_shard`` on each decoder layer and vision block, then on the root. The root's parameters
    (embeddings, final norm, LM head) stay gathered from its forward until its backward: odb's
    chunked loss applies the LM head after the model's forward returns, and again (recomputed)
    in the backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    base = hf_model(model)
    blocks = set(getattr(base, "_no_split_modules", None) or ())
    if not blocks:
        raise ValueError(f"{type(base).__name__} names no layer classes (_no_split_modules) to shard one by one; "
                         "use --backend deepspeed")
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype(settings),
                                 reduce_dtype=torch.bfloat16 if settings.reduce_dtype == "bf16" else torch.float32)
    offload = CPUOffloadPolicy() if _offloaded(settings, device) else OffloadPolicy()
    # a vision block's inputs are not cast: its rotary cos / sin come in fp32, as under DeepSpeed
    # (its hidden states are already in the compute precision)
    vision = getattr(getattr(base, "model", None), "visual", None)
    in_vision = {id(m) for m in vision.modules()} if vision is not None else set()
    uncast = dataclasses.replace(mixed, cast_forward_inputs=False)
    for unit in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(unit, reshard_after_forward=settings.reshard_after_forward, offload_policy=offload,
                    mp_policy=uncast if id(unit) in in_vision else mixed)
    fully_shard(model, reshard_after_forward=False, mp_policy=mixed, offload_policy=offload)


class Fsdp2Backend:
    """A ``fully_shard``-ed model and its optimizer as odb's :class:`~odb.training.backends.base.Backend`.

    Args:
        model: the sharded model (the root is an ``FSDPModule``).
        optimizer: over its trainable (sharded) parameters.
        settings: clipping, precision.
        device: the compute device (offloaded shards live on the CPU).
        lora: the model is a PEFT model: checkpoints hold only the trained weights.
    """

    name = "fsdp2"

    def __init__(self, model, optimizer: torch.optim.Optimizer, *, settings: Fsdp2Settings, device: torch.device,
                 lora: bool) -> None:
        self.module = model
        self.optimizer = optimizer
        self.settings = settings
        self.device = device
        self.lora = lora
        self._sync: bool | None = None  # what set_requires_gradient_sync was last given

    def __call__(self, **batch: Any) -> Any:
        return self.module(**batch)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        # by default gradients are reduce-scattered only after the step's last backward; until then
        # each rank accumulates whole (unsharded) fp32 gradients: 4 bytes per trained parameter
        sync = sync or self.settings.reduce_every_micro_batch
        if sync != self._sync:  # (it walks every module)
            self.module.set_requires_gradient_sync(sync)
            self._sync = sync
        loss.backward()

    def step(self) -> None:
        if self.settings.gradient_clipping:
            params = [p for p in self.module.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.settings.gradient_clipping)  # the norm over every shard
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def pristine(self):
        return optimizer_kept_fresh(self.optimizer)

    def release_cache(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        # the root's parameters (every unit's, without reshard_after_forward) stay gathered after a
        # forward without a backward
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _options(self, **kwargs: Any):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.lora, **kwargs)

    def _frozen(self) -> set[str]:
        """Every name of a frozen parameter (a tied LM head's too, which ``ignore_frozen_params`` keeps)."""
        return {name for name, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.module, self.optimizer, options=self._options())
        if self.lora:
            frozen = self._frozen()
            model_state = {k: v for k, v in model_state.items() if k not in frozen}
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, folder: Path, tag: str) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=folder / tag / DCP_FOLDER)
        dist.barrier()
        if dist.get_rank() == 0:  # as DeepSpeed does: the tag is complete, resume finds it as 'latest'
            (folder / "latest").write_text(tag)

    def load(self, folder: Path, tag: str) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = folder / tag / DCP_FOLDER
        found = torch.tensor([int((path / ".metadata").is_file())])
        dist.all_reduce(found, op=dist.ReduceOp.MIN)  # every rank sees it (a shared filesystem), or none loads
        if not found.item():
            raise FileNotFoundError(f"--resume: no FSDP2 checkpoint {path} (a checkpoint of --backend deepspeed? "
                                    "resume with the backend that saved it)")
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        # under LoRA the frozen weights are not in the checkpoint: they stay as --model built them
        result = set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                                optim_state_dict=state["optimizer"], options=self._options(strict=not self.lora))
        frozen = self._frozen()
        wrong = [*(k for k in result.missing_keys if k not in frozen), *result.unexpected_keys]
        if wrong:
            raise ValueError(f"--resume: {path} does not fit this model: {sorted(wrong)[:4]}")

    def full_state_dict(self, *, dtype: torch.dtype | None, trainable_only: bool) -> dict[str, torch.Tensor] | None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        dtype = dtype or param_dtype(self.settings)
        state = get_model_state_dict(self.module, options=StateDictOptions(  # gathered to rank 0's CPU only
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only))
        if dist.get_rank() != 0:
            return None
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

