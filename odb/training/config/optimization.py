"""The optimization's settings: the optimizer, the learning rate and its default
(:func:`default_lr`), and the backend with its own settings (DeepSpeed's JSON as DeepSpeed's,
:class:`Fsdp2Settings`). A backend's name is one of :data:`BACKENDS`; what differs between them
lives in :mod:`odb.training.backends`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from odb.settings import check, check_bool, check_number, field_names, flag

__all__ = ["BACKEND_FILES", "BACKENDS", "BackendFile", "Fsdp2Settings", "OptimizationSettings", "default_lr"]

OPTIMIZERS = ("adamw", "sgd")


FULL_LR, LORA_LR, DEMO_LR = 2e-5, 2e-4, 1e-3
"""The learning rates a run gets without --lr: full fine-tuning of a pretrained model (the 1e-5 to
2e-5 of the common 7B-70B SFT recipes), LoRA (1e-4 to 2e-4; its adapters start at zero), and the
bundled tiny random-init model of the CPU demo, which learns nothing at the others."""


def default_lr(*, lora: bool, bundled_model: bool) -> float:
    """The peak learning rate of a run that names none (:data:`FULL_LR`, :data:`LORA_LR`, :data:`DEMO_LR`)."""
    return DEMO_LR if bundled_model else LORA_LR if lora else FULL_LR


BACKENDS = ("deepspeed", "fsdp2")


@dataclass(frozen=True)
class BackendFile:
    """The settings file of a backend (:data:`BACKEND_FILES`), as the flags name it: light, read
    before torch is imported."""

    flag: str
    help: str
    what: str
    """How an error names the file."""
    example: str
    """A bundled file to name in an error's fix."""
    unread: Any = None
    """Settings of the right type before the file is read (the light check's stand-in)."""


@dataclass(frozen=True, kw_only=True)
class Fsdp2Settings:
    """FSDP2's settings (``--fsdp_config``, e.g. ``configs/fsdp2.json``; :mod:`odb.training.backends.fsdp2`)."""

    mixed_precision: str = "auto"
    """'bf16': forward and backward in bf16 over fp32 sharded parameters (the optimizer's); 'fp32';
    'auto' (resolved at start): bf16 on a GPU that has it, else fp32."""
    reduce_dtype: str = "fp32"
    """The precision gradients are reduce-scattered in: 'fp32' or 'bf16'."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (gathered again for its backward):
    less memory, one more all-gather per layer and micro-batch."""
    cpu_offload: bool = False
    """Keep the parameter shards, gradients and optimizer state in CPU memory (GPU runs; the
    optimizer steps on the CPU)."""
    reduce_every_micro_batch: bool = False
    """Reduce-scatter the gradients after every micro-batch's backward, accumulating them sharded
    (1/W of the memory, GAS times the reductions), instead of only after the step's last one,
    accumulating whole fp32 gradients on each rank (4 bytes per trained parameter): turn it on for
    large full fine-tuning with GAS > 1. The gradient is the same."""
    gradient_clipping: float = 1.0
    """Clip the gradients' global norm to this before each step (0: no clipping)."""

    def __post_init__(self) -> None:
        check(self.mixed_precision in ("auto", "bf16", "fp32"),
               f"--fsdp_config 'mixed_precision' must be 'auto', 'bf16' or 'fp32', got {self.mixed_precision!r}")
        check(self.reduce_dtype in ("fp32", "bf16"),
               f"--fsdp_config 'reduce_dtype' must be 'fp32' or 'bf16', got {self.reduce_dtype!r}")
        check_bool("--fsdp_config 'reshard_after_forward'", self.reshard_after_forward)
        check_bool("--fsdp_config 'cpu_offload'", self.cpu_offload)
        check_bool("--fsdp_config 'reduce_every_micro_batch'", self.reduce_every_micro_batch)
        check_number("--fsdp_config 'gradient_clipping'", self.gradient_clipping, 0)


BACKEND_FILES = {
    "deepspeed": BackendFile("--deepspeed_config", "DeepSpeed JSON (--backend deepspeed); its batch keys may be "
                             "\"auto\" (odb fills them in)", "DeepSpeed config", "configs/ds_zero2.json"),
    "fsdp2": BackendFile("--fsdp_config", "FSDP2 settings JSON (--backend fsdp2): "
                         + ", ".join(field_names(Fsdp2Settings)), "FSDP2 config",
                         "configs/fsdp2.json", Fsdp2Settings()),
}
"""Each backend's settings file, by ``--backend`` name: its flag (also the
:class:`odb.training.launch.flags.FileDefaults` field of its default file, without the dashes)."""


@dataclass(frozen=True, kw_only=True)
class OptimizationSettings:
    """The optimizer, its learning rate by progress, and the backend's own settings."""

    optimizer: str = field(default="adamw", metadata=flag(choices=OPTIMIZERS))
    """A torch optimizer (unless DeepSpeed's JSON declares one)."""
    lr: float = field(default=FULL_LR, metadata=flag(shown_default=f"{FULL_LR:g} (full fine-tuning), {LORA_LR:g} "
                                                                   f"(--lora), {DEMO_LR:g} (the bundled tiny model)"))
    """The peak learning rate: linear warmup, then cosine decay to a tenth of it by progress (samples
    trained over those planned); left out, the method's."""
    warmup_ratio: float = 0.03
    """The share of the planned samples the learning rate warms up over."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    backend: str = field(default="deepspeed", metadata=flag(choices=BACKENDS))
    """deepspeed (ZeRO 0-3, launch with ``deepspeed``) or fsdp2 (PyTorch ``fully_shard``, launch
    with ``torchrun``)."""
    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    """DeepSpeed's JSON, resolved: odb's batch values and "auto" precision filled in (empty under FSDP2)."""
    fsdp2: Fsdp2Settings | None = None
    """FSDP2's settings, resolved (None under DeepSpeed)."""

    def __post_init__(self) -> None:
        check(self.backend in BACKENDS, f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        check(self.fsdp2 is None or isinstance(self.fsdp2, Fsdp2Settings),
               f"--fsdp_config must give Fsdp2Settings, got {self.fsdp2!r}")
        check(self.optimizer in OPTIMIZERS, f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check_number("--lr", self.lr, 0)
        check_number("--warmup_ratio", self.warmup_ratio, 0, 1)
        check_number("--weight_decay", self.weight_decay, 0)
        check(isinstance(self.deepspeed, Mapping),
               f"--deepspeed_config must give a JSON object, got {self.deepspeed!r}")
        # each backend's settings are the field named after it: the chosen one's given, no other's
        check(getattr(self, self.backend) is not None,
               f"--backend {self.backend} needs its settings ({self.backend}=...)")
        given = [name for name in BACKENDS if name != self.backend and getattr(self, name)]
        check(not given, f"the settings of --backend {', '.join(given)} go with that backend; this run is "
                          f"--backend {self.backend}")
