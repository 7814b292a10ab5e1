"""The run's settings: one frozen, keyword-only dataclass, grouped as a user thinks of a run.

:class:`RunConfig` nests the groups (what to train, the data, odb's batching, the optimization,
checkpoints, logging); :func:`odb.training.cli.parse_config` builds it from the flags and the JSON
files, once, before any process group is joined; nothing changes it afterwards. Every JSON config
of odb (odb's batching, data, LoRA) is read by :func:`load_json_config`, strictly: a key it does
not know is an error naming the file, the key and the known keys. DeepSpeed's JSON stays
DeepSpeed's (:mod:`odb.training.backends.deepspeed`).

The resolved config is saved with each checkpoint (``run_config.json``) and in ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from odb.batching.config import OdbConfig, check_bool, check_int, check_number, check_str, load_json_config
from odb.data.processing import DataConfig
from odb.training.loss import DEFAULT_LOSS_CHUNK_TOKENS

__all__ = ["BACKENDS", "CheckpointSettings", "DataSettings", "Fsdp2Settings", "LoggingSettings", "ModelSettings",
           "OptimizationSettings", "RunConfig", "RunSettings", "load_json_config", "lora_keys"]

OPTIMIZERS = ("adamw", "sgd")
BACKENDS = ("deepspeed", "fsdp2")
REPORT_TO = ("none", "wandb")
_MAX_TIMEOUT_S = int(timedelta.max.total_seconds())


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def lora_keys() -> list[str]:
    """The keys a LoRA JSON may hold: peft's ``LoraConfig`` fields (odb sets ``task_type``)."""
    from peft import LoraConfig

    return [name for name in field_names(LoraConfig) if name not in ("task_type", "peft_type")]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_optional_int(name: str, value: Any, minimum: int) -> None:
    if value is not None:
        check_int(name, value, minimum)


def _check_optional_str(name: str, value: Any) -> None:
    if value is not None:
        check_str(name, value)


def _is_list_of(value: Any, is_item: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(is_item(item) for item in value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_regex(value: Any) -> bool:
    """peft matches a string of module names, and a pattern's keys, as a regular expression."""
    try:
        re.compile(value)
    except (re.error, TypeError):
        return False
    return True


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_LORA_BIAS = ("none", "all", "lora_only")
_MAX_LORA_RANK = 2**16
_LORA_INITS = ("gaussian", "eva", "olora", "pissa", "corda", "loftq", "orthogonal", "mica")
_NAMES = ("a module name regex, a list of names or null",
          lambda v: v is None or _is_str(v) and _is_regex(v) or _is_list_of(v, _is_str))
_LORA_SHAPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "target_modules": _NAMES,
    "exclude_modules": _NAMES,
    "modules_to_save": ("a list of module names or null", lambda v: v is None or _is_list_of(v, _is_str)),
    "target_parameters": ("a list of parameter names or null", lambda v: v is None or _is_list_of(v, _is_str)),
    "layers_to_transform": ("a layer index, a list of them or null",
                            lambda v: v is None or _is_count(v) or _is_list_of(v, _is_count)),
    "bias": (f"one of {_LORA_BIAS}", lambda v: v in _LORA_BIAS),
    "init_lora_weights": (f"true, false or one of {_LORA_INITS} or 'pissa_niter_<N>'",
                          lambda v: isinstance(v, bool) or v in _LORA_INITS
                          or _is_str(v) and re.fullmatch(r"pissa_niter_\d+", v) is not None),
    "rank_pattern": (f"an object of module name regex -> rank in [1, {_MAX_LORA_RANK}]",
                     lambda v: isinstance(v, dict) and all(_is_regex(k) and _is_count(r) and 1 <= r <= _MAX_LORA_RANK
                                                           for k, r in v.items())),
    "alpha_pattern": ("an object of module name regex -> alpha >= 0", lambda v: isinstance(v, dict) and all(
        _is_regex(k) and _is_number(a) and a >= 0 for k, a in v.items())),
    **{name: ("true or false", lambda v: isinstance(v, bool))
       for name in ("fan_in_fan_out", "inference_mode", "use_dora", "use_rslora")},
}
"""The shape of each LoRA key a user is likely to type (peft itself checks few of them, and fails
with a TypeError or AttributeError from inside when the model is built)."""


def _check_lora(lora: Any) -> None:
    """The LoRA settings checked before peft sees them; then peft's own ``LoraConfig`` built once,
    its refusal naming the key."""
    _check(isinstance(lora, Mapping), f"--lora must be a JSON object of LoraConfig fields, got {lora!r}")
    if "r" in lora:
        check_int("--lora 'r'", lora["r"], 1)
        _check(lora["r"] <= _MAX_LORA_RANK, f"--lora 'r' must be <= {_MAX_LORA_RANK} (a rank above the model's "
                                             f"width adds nothing), got {lora['r']}")
    if "lora_alpha" in lora:
        check_number("--lora 'lora_alpha'", lora["lora_alpha"], 0)
    if "lora_dropout" in lora:
        check_number("--lora 'lora_dropout'", lora["lora_dropout"], 0, 1)
    for name, (shape, is_ok) in _LORA_SHAPES.items():
        _check(name not in lora or is_ok(lora[name]), f"--lora '{name}' must be {shape}, got {lora.get(name)!r}")
    from peft import LoraConfig

    try:
        LoraConfig(task_type="CAUSAL_LM", **lora)
    except Exception as err:  # peft raises what it likes: name the keys it refuses on their own
        refused = [key for key in lora if not _lora_accepts(key, lora[key])] or sorted(lora)
        shown = ", ".join(f"'{key}'={lora[key]!r}" for key in refused)
        raise ValueError(f"--lora {shown}: peft's LoraConfig refuses it ({type(err).__name__}: {err})") from err


def _lora_accepts(key: str, value: Any) -> bool:
    from peft import LoraConfig

    try:
        LoraConfig(task_type="CAUSAL_LM", **{key: value})
    except Exception:
        return False
    return True


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
        check_str("--model", self.path)
        check_str("--tokenizer", self.tokenizer)
        if self.lora is not None:
            _check_lora(self.lora)
        check_bool("--gradient_checkpointing", self.gradient_checkpointing)
        chunk = self.loss_chunk_tokens  # (the command line's 0 is None here)
        _check(chunk is None or _is_count(chunk) and 1 <= chunk < 2**63,
               f"--loss_chunk_tokens must be an integer >= 0 (0: the model's full logits), got {chunk!r}")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How long, where, and how the ranks meet."""

    output_dir: str = "runs/default"
    epochs: int = 1
    """Passes over the data (join mode)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in this process."""
    dist_timeout_s: int = 600
    """How long a rank may go without a heartbeat or without progress before every rank stops
    (``odb.training.faults``); longer than the slowest step, evaluation or checkpoint save. The
    collectives' own timeouts are a little longer, as a backstop."""

    def __post_init__(self) -> None:
        check_str("--output_dir", self.output_dir)
        check_int("--epochs", self.epochs, 1)
        _check_optional_int("--max_steps", self.max_steps, 1)
        check_int("--dist_timeout_s", self.dist_timeout_s, 1)
        _check(self.dist_timeout_s <= _MAX_TIMEOUT_S, f"--dist_timeout_s must be <= {_MAX_TIMEOUT_S} (Python's "
                                                      f"longest timedelta), got {self.dist_timeout_s}")


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
        check_str("--data", self.path)
        _check(isinstance(self.processing, DataConfig),
               f"--data_config must give a DataConfig, got {self.processing!r}")
        _check_optional_int("--max_samples", self.max_samples, 1)
        _check_optional_str("--eval_data", self.eval_path)
        check_number("--val_ratio", self.val_ratio, 0)
        _check(self.val_ratio < 1, f"--val_ratio must be within [0, 1), got {self.val_ratio}")
        _check(not (self.eval_path and self.val_ratio), "pass either --eval_data or --val_ratio, not both")
        check_int("--eval_steps", self.eval_steps, 0)
        _check(self.has_eval or not self.eval_steps, "--eval_steps needs validation data: pass --eval_data FILE "
                                                     "or --val_ratio R")
        check_int("--num_workers", self.num_workers, 0)
        check_int("--prefetch_factor", self.prefetch_factor, 1)


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
        _check(self.mixed_precision in ("auto", "bf16", "fp32"),
               f"--fsdp_config 'mixed_precision' must be 'auto', 'bf16' or 'fp32', got {self.mixed_precision!r}")
        _check(self.reduce_dtype in ("fp32", "bf16"),
               f"--fsdp_config 'reduce_dtype' must be 'fp32' or 'bf16', got {self.reduce_dtype!r}")
        check_bool("--fsdp_config 'reshard_after_forward'", self.reshard_after_forward)
        check_bool("--fsdp_config 'cpu_offload'", self.cpu_offload)
        check_bool("--fsdp_config 'reduce_every_micro_batch'", self.reduce_every_micro_batch)
        check_number("--fsdp_config 'gradient_clipping'", self.gradient_clipping, 0)


@dataclass(frozen=True, kw_only=True)
class OptimizationSettings:
    """The optimizer, its learning rate by progress, and the backend's own settings."""

    optimizer: str = "adamw"
    """'adamw' or 'sgd' (a torch optimizer, unless DeepSpeed's JSON declares one)."""
    lr: float = 1e-3
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    backend: str = "deepspeed"
    """'deepspeed' (``deepspeed launch/train.py``) or 'fsdp2' (``torchrun ... --backend fsdp2``)."""
    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    """DeepSpeed's JSON, resolved: odb's batch values and "auto" precision filled in (empty under FSDP2)."""
    fsdp2: Fsdp2Settings | None = None
    """FSDP2's settings, resolved (None under DeepSpeed)."""

    def __post_init__(self) -> None:
        _check(self.backend in BACKENDS, f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        _check(self.fsdp2 is None or isinstance(self.fsdp2, Fsdp2Settings),
               f"--fsdp_config must give Fsdp2Settings, got {self.fsdp2!r}")
        _check(self.optimizer in OPTIMIZERS, f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check_number("--lr", self.lr, 0)
        check_number("--warmup_ratio", self.warmup_ratio, 0, 1)
        check_number("--weight_decay", self.weight_decay, 0)
        _check(isinstance(self.deepspeed, Mapping),
               f"--deepspeed_config must give a JSON object, got {self.deepspeed!r}")
        # each backend's settings are the field named after it: the chosen one's given, no other's
        _check(getattr(self, self.backend) is not None,
               f"--backend {self.backend} needs its settings ({self.backend}=...)")
        given = [name for name in BACKENDS if name != self.backend and getattr(self, name)]
        _check(not given, f"the settings of --backend {', '.join(given)} go with that backend; this run is "
                          f"--backend {self.backend}")


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
        check_int("--save_steps", self.save_steps, 0)
        check_bool("final (--no_final_checkpoint)", self.final)
        _check_optional_str("--resume", self.resume)
        _check_optional_int("--save_total_limit", self.save_total_limit, 1)
        check_bool("--save_hf", self.save_hf)
        check_bool("--save_adapter_only", self.save_adapter_only)
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
        _check(self.report_to in REPORT_TO, f"--report_to must be one of {REPORT_TO}, got {self.report_to!r}")
        check_str("--wandb_project", self.wandb_project)
        _check_optional_str("--run_name", self.run_name)
        _check(isinstance(self.wandb_tags, (list, tuple)) and all(isinstance(t, str) for t in self.wandb_tags),
               f"--wandb_tags must be a list of strings, got {self.wandb_tags!r}")
        check_bool("--audit_ids", self.audit_ids)
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
