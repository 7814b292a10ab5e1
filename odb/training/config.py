"""The run's settings: one frozen, keyword-only dataclass, grouped as a user thinks of a run.

:class:`RunConfig` nests the groups (what to train, the data, odb's batching, the optimization,
checkpoints, logging); :func:`odb.training.cli.parse_config` builds it from the flags and the JSON
files, once, before any process group is joined; nothing changes it afterwards. Every JSON config
of odb (odb's batching, data, LoRA) is read by :func:`load_json_config`, strictly: a key it does
not know is an error naming the file, the key and the known keys. DeepSpeed's JSON stays
DeepSpeed's (:mod:`odb.training.ds_config`).

The resolved config is saved with each checkpoint (``run_config.json``) and in ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from odb.batching.config import OdbConfig, load_json_config
from odb.data.processing import DataConfig
from odb.training.loss import DEFAULT_LOSS_CHUNK_TOKENS

__all__ = ["CheckpointSettings", "DataSettings", "LoggingSettings", "ModelSettings", "OptimizationSettings",
           "RunConfig", "RunSettings", "load_json_config", "lora_keys"]

OPTIMIZERS = ("adamw", "sgd")
REPORT_TO = ("none", "wandb")


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def lora_keys() -> list[str]:
    """The keys a LoRA JSON may hold: peft's ``LoraConfig`` fields (odb sets ``task_type``)."""
    from peft import LoraConfig

    return [name for name in field_names(LoraConfig) if name not in ("task_type", "peft_type")]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """What to fine-tune."""

    path: str
    """A local Hugging Face model folder, or a model config JSON (random init) (``--model``)."""
    tokenizer: str
    """Tokenizer folder (``--tokenizer``; default: the model folder, else the bundled one)."""
    lora: Mapping[str, Any] | None = None
    """PEFT LoRA settings (``--lora``), or None to train every weight."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them
    (``--gradient_checkpointing``; non-reentrant, vision blocks too): less activation memory, about
    one more forward pass of compute."""
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
    """The loss from the final hidden states, the LM head applied to this many tokens at a time and
    recomputed in the backward (``--loss_chunk_tokens``; 0 on the command line = None: the model's
    full logits, fp32 over the whole micro-batch)."""

    def __post_init__(self) -> None:
        _check(self.loss_chunk_tokens is None or self.loss_chunk_tokens >= 1, "--loss_chunk_tokens must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How long, where, and how the ranks meet."""

    output_dir: str = "runs/default"
    epochs: int = 1
    """Passes over the data (join mode)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in this process."""
    dist_timeout_s: int = 600
    """Timeout of every collective."""

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "--epochs must be >= 1")
        _check(self.max_steps is None or self.max_steps >= 1, "--max_steps must be >= 1")
        _check(self.dist_timeout_s >= 1, "--dist_timeout_s must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Where records come from and how they become samples."""

    path: str
    """JSONL / JSON / Parquet file or folder (``--data``)."""
    processing: DataConfig = field(default_factory=DataConfig)
    """Format, labels, augmentation, image sizes, strict (``--data_config``)."""
    max_samples: int | None = None
    """Use only the first N records."""
    num_workers: int = 1
    """DataLoader workers per rank."""
    prefetch_factor: int = 4
    eval_path: str | None = None
    """Validation records (``--eval_data``), processed as the training data but without augmentation."""
    val_ratio: float = 0.0
    """Hold out this share of ``path`` as validation data instead (``--val_ratio``; a seeded split)."""
    eval_steps: int = 0
    """Evaluate every N optimizer steps (``--eval_steps``; 0: only at the end); needs validation data."""

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None or self.val_ratio > 0

    def __post_init__(self) -> None:
        _check(self.max_samples is None or self.max_samples >= 1, "--max_samples must be >= 1")
        _check(0.0 <= self.val_ratio < 1.0, "--val_ratio must be within [0, 1)")
        _check(not (self.eval_path and self.val_ratio), "pass either --eval_data or --val_ratio, not both")
        _check(self.eval_steps >= 0, "--eval_steps must be >= 0")
        _check(self.has_eval or not self.eval_steps, "--eval_steps needs validation data: pass --eval_data FILE "
                                                     "or --val_ratio R")
        _check(self.num_workers >= 0, "--num_workers must be >= 0")
        _check(self.prefetch_factor >= 1, "--prefetch_factor must be >= 1")


@dataclass(frozen=True, kw_only=True)
class OptimizationSettings:
    """The optimizer, its learning rate by progress, and DeepSpeed's own settings."""

    optimizer: str = "adamw"
    """'adamw' or 'sgd' (a torch optimizer, unless DeepSpeed's JSON declares one)."""
    lr: float = 1e-3
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    """DeepSpeed's JSON, resolved: odb's batch values and "auto" precision filled in."""

    def __post_init__(self) -> None:
        _check(self.optimizer in OPTIMIZERS, f"--optimizer must be one of {OPTIMIZERS}")
        _check(0.0 <= self.warmup_ratio <= 1.0, "--warmup_ratio must be within [0, 1]")


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """When to save, and where to continue from."""

    save_steps: int = 0
    """Save every N steps (0: only at the end)."""
    final: bool = True
    """Save at the end (``--no_final_checkpoint`` turns it off)."""
    resume: str | None = None
    """Continue from OUTPUT_DIR/checkpoints: 'latest' or a tag such as 'step20'."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints (``--save_total_limit``; None: all)."""
    save_hf: bool = False
    """Write a Hugging Face model to OUTPUT_DIR/hf at the end (``--save_hf``): LoRA merged."""
    save_adapter_only: bool = False
    """With ``--save_hf`` and LoRA: write the PEFT adapter instead of the merged model."""

    def __post_init__(self) -> None:
        _check(self.save_steps >= 0, "--save_steps must be >= 0")
        _check(self.save_total_limit is None or self.save_total_limit >= 1, "--save_total_limit must be >= 1")
        _check(self.save_hf or not self.save_adapter_only, "--save_adapter_only needs --save_hf")


@dataclass(frozen=True, kw_only=True)
class LoggingSettings:
    """What the run writes besides metrics.jsonl and summary.json."""

    report_to: str = "none"
    """'wandb': also log to Weights & Biases (rank 0, one run)."""
    wandb_project: str = "odb"
    run_name: str | None = None
    """W&B run name (default: the output_dir's name)."""
    wandb_tags: tuple[str, ...] = ()
    audit_ids: bool = False
    """Write emitted_ids.rank<R>.jsonl: the dataset indices of every micro-batch."""

    def __post_init__(self) -> None:
        _check(self.report_to in REPORT_TO, f"--report_to must be one of {REPORT_TO}")
        object.__setattr__(self, "wandb_tags", tuple(self.wandb_tags))


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs, identical on every rank."""

    model: ModelSettings
    data: DataSettings
    batching: OdbConfig
    """odb's micro-batch settings (``--odb_config``); its seed is the run's one seed: sample
    order, augmentation, random init."""
    optimization: OptimizationSettings = field(default_factory=OptimizationSettings)
    run: RunSettings = field(default_factory=RunSettings)
    checkpoints: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)

    @property
    def seed(self) -> int:
        return self.batching.seed

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, grouped as the dataclasses are."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
