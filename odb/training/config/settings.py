"""The run's settings: one frozen, keyword-only dataclass, grouped as a user thinks of a run.

:class:`RunConfig` nests the groups (what to train, the data, odb's batching, the optimization,
checkpoints, logging); :func:`odb.training.launch.flags.parse_config` builds it from the flags and the JSON
files, once, before any process group is joined; nothing changes it afterwards. Every JSON config
of odb (odb's batching, data, LoRA) is read by :func:`load_json_config`, strictly: a key it does
not know is an error naming the file, the key and the known keys. DeepSpeed's JSON stays
DeepSpeed's (:mod:`odb.training.backends.deepspeed`).

The resolved config is saved with each checkpoint (``run_config.json``) and in ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from odb.batching.config import OdbConfig
from odb.batching.mixture import MIX_BY, MIX_EPOCH
from odb.data.config import DataConfig
from odb.data.mixture import SourceSpec
from odb.settings import (
    check,
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    check_optional_str,
    check_str,
    flag,
)
from odb.telemetry.trackers import TRACKERS
from odb.training.config.lora import check_lora
from odb.training.config.objective import ObjectiveSettings, padded_refusal
from odb.training.config.optimization import OptimizationSettings

__all__ = ["DEFAULT_LOSS_CHUNK_TOKENS", "CheckpointSettings", "DataSettings", "LoggingSettings", "ModelSettings",
           "PreflightSettings", "RunConfig", "RunSettings"]

DEFAULT_LOSS_CHUNK_TOKENS = 1024  # (odb.training.step.loss) at V = 152064 a chunk's fp32 logits are 0.6 GB
REPORT_TO = ("none", *TRACKERS)
_MAX_TIMEOUT_S = int(timedelta.max.total_seconds())


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list on the command line (spaces around the names dropped)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """What to fine-tune."""

    path: str = field(metadata=flag("--model"))
    """A local Hugging Face model folder, or a model config JSON (random init)."""
    tokenizer: str = field(metadata=flag("--tokenizer", shown_default=(
        "the model folder, else the bundled one: data/vl_tokenizer for configs/tiny_vl_model.json, data/tokenizer "
        "for the others")))
    """Tokenizer folder (from save_pretrained)."""
    lora: Mapping[str, Any] | None = None
    """Train PEFT LoRA adapters: LoraConfig fields (rank, alpha, target modules) from a JSON file;
    None trains every weight."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them
    (non-reentrant, vision blocks too): less activation memory, about one more forward pass of
    compute."""
    loss_chunk_tokens: int | None = field(default=DEFAULT_LOSS_CHUNK_TOKENS, metadata=flag(parse=lambda v: v or None))
    """Apply the LM head and the loss to this many tokens at a time (recomputed in the backward),
    never materializing the whole micro-batch's fp32 logits; 0 on the command line (None): the
    model's full logits."""
    sequence_parallel_size: int = 1
    """Ranks that train one packed row together (DeepSpeed's Ulysses attention): each holds 1/S of
    every row, and a micro-batch holds up to S x max_tokens tokens, so samples up to that long train
    whole. S divides the number of ranks and the model's attention heads; groups are consecutive
    ranks (keep them on one node). Packed text models only."""

    def __post_init__(self) -> None:
        check_str("--model", self.path)
        check_str("--tokenizer", self.tokenizer)
        if self.lora is not None:
            check_lora(self.lora)
        check_bool("--gradient_checkpointing", self.gradient_checkpointing)
        chunk = self.loss_chunk_tokens  # (the command line's 0 is None here)
        check(chunk is None or isinstance(chunk, int) and not isinstance(chunk, bool) and 1 <= chunk < 2**63,
               f"--loss_chunk_tokens must be an integer >= 0 (0: the model's full logits), got {chunk!r}")
        check_int("--sequence_parallel_size", self.sequence_parallel_size, 1)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How long, where, and how the ranks meet."""

    output_dir: str = "runs/default"
    """Where the run writes its checkpoints, metrics.jsonl, summary.json and hf/ (created if missing)."""
    epochs: int = 1
    """Passes over the data (join mode)."""
    max_steps: int | None = None
    """Stop once the run has trained this many optimizer steps (counted over the run: a resume's
    earlier steps count, so a requeued job with the same flags trains none more)."""
    dist_timeout_s: int = 600
    """Every rank stops (exit 71) when any rank has had no heartbeat or no progress this long
    (frozen, killed, stuck loading data; ``odb.training.run.watchdog``): make it longer than the slowest
    step, evaluation or checkpoint save. The collectives' own timeouts are a little longer, as a
    backstop."""

    def __post_init__(self) -> None:
        check_str("--output_dir", self.output_dir)
        check_int("--epochs", self.epochs, 1)
        check_optional_int("--max_steps", self.max_steps, 1)
        check_int("--dist_timeout_s", self.dist_timeout_s, 1)
        check(self.dist_timeout_s <= _MAX_TIMEOUT_S, f"--dist_timeout_s must be <= {_MAX_TIMEOUT_S} (Python's "
                                                      f"longest timedelta), got {self.dist_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Where records come from and how they become samples."""

    path: str = field(metadata=flag("--data", nargs="+"))
    """JSONL / JSON / Parquet file or folder (or a datasets.save_to_disk folder): messages, ShareGPT or
    LLaVA records. Several sources: NAME=PATH:WEIGHT each (weights on all or none; without, they are laid
    end to end), or a JSON object with name, path, weight and the source's own format, train_on,
    system_prompts, max_pixels, ... (docs/training.md#data-mixtures)."""
    sources: tuple[SourceSpec, ...] = ()
    """The named sources of a mixture (from --data's NAME=PATH:WEIGHT words or a recipe's list); empty:
    the one source ``path``."""
    mix_by: str = field(default="label_tokens", metadata=flag(choices=MIX_BY))
    """What a mixture's weights share out: trained label tokens, tokens, or samples."""
    mix_epoch: str = field(default="all", metadata=flag(choices=MIX_EPOCH))
    """A weighted mixture's epoch: 'all' (every record of every source at least once; the others are
    up-sampled, each repeat a sample of its own) or 'first' (every record at most once; the others are
    down-sampled, a seeded subset each epoch)."""
    processing: DataConfig = field(default_factory=DataConfig)
    """Format, labels, augmentation, image sizes, strict (``--data_config``)."""
    max_samples: int | None = None
    """Use only the first N records."""
    num_workers: int = 1
    """DataLoader workers per rank."""
    prefetch_factor: int = 4
    """Samples each DataLoader worker prepares ahead."""
    eval_path: str | None = field(default=None, metadata=flag("--eval_data", nargs="+"))
    """Validation records (same formats as --data), processed as the training data but without
    augmentation; several sources as NAME=PATH (their loss reported each: eval_loss/NAME)."""
    eval_sources: tuple[SourceSpec, ...] = ()
    """The named validation sources (from --eval_data's NAME=PATH words)."""
    val_ratio: float = 0.0
    """Hold out this share of --data for validation instead (a seeded split)."""
    eval_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end); needs --eval_data or --val_ratio."""
    streaming: bool = False
    """Read --data (a .jsonl or .parquet file, or a folder of such shards; several weighted sources: a
    streamed mixture) as a stream, never indexed: each pass deals the shards to the ranks in a seeded
    order and each rank reads its own front to back (Parquet by row group) through a shuffle buffer;
    exact-once per pass, no random access, resume by shard and offset (docs/training.md#streaming-sources)."""
    shuffle_buffer: int = 10000
    """--streaming: records each rank's shuffle buffer holds (1: the shards' own order)."""

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None or self.val_ratio > 0

    def __post_init__(self) -> None:
        check_str("--data", self.path)
        check(isinstance(self.processing, DataConfig),
               f"--data_config must give a DataConfig, got {self.processing!r}")
        check_optional_int("--max_samples", self.max_samples, 1)
        check_optional_str("--eval_data", self.eval_path)
        check_number("--val_ratio", self.val_ratio, 0)
        check(self.val_ratio < 1, f"--val_ratio must be within [0, 1), got {self.val_ratio}")
        check(not (self.eval_path and self.val_ratio), "pass either --eval_data or --val_ratio, not both")
        check_int("--eval_steps", self.eval_steps, 0)
        check(self.has_eval or not self.eval_steps, "--eval_steps needs validation data: pass --eval_data FILE "
                                                     "or --val_ratio R")
        check_int("--num_workers", self.num_workers, 0)
        check_int("--prefetch_factor", self.prefetch_factor, 1)
        check_bool("--streaming", self.streaming)
        check_int("--shuffle_buffer", self.shuffle_buffer, 1)
        if self.streaming:
            check(not self.sources or self.is_weighted,
                  "--streaming with several sources draws them by weight, each rank from its own shards (a streamed "
                  "mixture): give every source a weight (NAME=PATH:WEIGHT), or pass one --data PATH")
            check(not self.val_ratio, "--streaming reads each record once per pass in order, so no share can be held "
                                      "out: pass validation data with --eval_data instead of --val_ratio")
            check(self.max_samples is None, "--streaming counts no records up front, so --max_samples cannot pick the "
                                            "first N: stop the run with --max_steps, or drop --streaming")
        check(self.mix_by in MIX_BY, f"--mix_by must be one of {MIX_BY}, got {self.mix_by!r}")
        check(self.mix_epoch in MIX_EPOCH, f"--mix_epoch must be one of {MIX_EPOCH}, got {self.mix_epoch!r}")
        for name, flag_ in (("sources", "--data"), ("eval_sources", "--eval_data")):
            value = getattr(self, name)
            check(isinstance(value, (list, tuple)) and all(isinstance(s, SourceSpec) for s in value),
                  f"{flag_} sources must be a list of named sources (odb.data.mixture.SourceSpec), got {value!r}")
            object.__setattr__(self, name, tuple(value))

    @property
    def is_weighted(self) -> bool:
        """Whether the training data is a weighted mixture (sources with weights)."""
        return any(s.weight is not None for s in self.sources)


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """When to save, and where to continue from."""

    save_steps: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    final: bool = field(default=True, metadata=flag("--no_final_checkpoint", action="store_false"))
    """Checkpoint at the end (the flag skips it)."""
    resume: str | None = field(default=None, metadata=flag(nargs="?", const="latest"))
    """Continue from OUTPUT_DIR/checkpoints: latest (the flag alone), a tag such as step20, or auto
    (the latest if there is one, else the newest complete one, else start over: for torchrun
    --max-restarts and requeued jobs)."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints (None: all)."""
    save_hf: bool = False
    """Write a Hugging Face model (from_pretrained) to OUTPUT_DIR/hf at the end; LoRA merged."""
    save_adapter_only: bool = False
    """With --save_hf and --lora: write the PEFT adapter instead of the merged model."""

    def __post_init__(self) -> None:
        check_int("--save_steps", self.save_steps, 0)
        check_bool("final (--no_final_checkpoint)", self.final)
        check_optional_str("--resume", self.resume)
        check_optional_int("--save_total_limit", self.save_total_limit, 1)
        check_bool("--save_hf", self.save_hf)
        check_bool("--save_adapter_only", self.save_adapter_only)
        check(self.save_hf or not self.save_adapter_only, "--save_adapter_only needs --save_hf")


@dataclass(frozen=True, kw_only=True)
class LoggingSettings:
    """What the run writes besides metrics.jsonl and summary.json."""

    report_to: tuple[str, ...] = field(default=(), metadata=flag(parse=_names, shown_default="none"))
    """Also log the metrics rows to these trackers, comma-separated: wandb, tensorboard, mlflow
    (rank 0, one run per job, each offline-capable; docs/operations.md#trackers), or none."""
    wandb_project: str | None = field(default=None, metadata=flag(shown_default="$WANDB_PROJECT, else odb"))
    """The W&B project (over the environment's WANDB_PROJECT)."""
    run_name: str | None = field(default=None, metadata=flag(shown_default="the output_dir's name"))
    """The run's name in W&B and MLflow."""
    wandb_tags: tuple[str, ...] = field(default=(), metadata=flag(parse=lambda v: tuple(t for t in v.split(",") if t)))
    """W&B tags, comma-separated on the command line."""
    audit_ids: bool = False
    """Write emitted_ids.rank<R>.jsonl: every micro-batch's record indices (within their source for a
    mixture), source names and epochs."""
    log_steps: int = 10
    """Rank 0 prints a line every N steps (step, samples, loss, lr, tokens/s, MFU, padding, sync
    efficiency, elapsed, ETA) where no terminal shows the progress bar (SLURM logs, files); 0: never. A
    mixture's loss/<source> rows cover the same N steps (every step with 0)."""

    def __post_init__(self) -> None:
        names = _names(self.report_to) if isinstance(self.report_to, str) else self.report_to  # (a JSON config's)
        check(isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names),
              f"--report_to must be a comma-separated list of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        unknown = [n for n in names if n not in REPORT_TO]
        check(not unknown, f"--report_to: unknown {', '.join(map(repr, unknown))}; pass some of "
                           f"{', '.join(TRACKERS)} (comma-separated), or none")
        check("none" not in names or set(names) == {"none"},
              f"--report_to: none means no tracker, yet {','.join(names)} names some; drop none, or the others")
        object.__setattr__(self, "report_to", tuple(dict.fromkeys(n for n in names if n != "none")))
        check_optional_str("--wandb_project", self.wandb_project)
        check_optional_str("--run_name", self.run_name)
        check(isinstance(self.wandb_tags, (list, tuple)) and all(isinstance(t, str) for t in self.wandb_tags),
               f"--wandb_tags must be a list of strings, got {self.wandb_tags!r}")
        check_bool("--audit_ids", self.audit_ids)
        check_int("--log_steps", self.log_steps, 0)
        object.__setattr__(self, "wandb_tags", tuple(self.wandb_tags))


PREFLIGHT = ("on", "off")


@dataclass(frozen=True, kw_only=True)
class PreflightSettings:
    """The worst-case step measured before the first sample (:mod:`odb.training.run.preflight`)."""

    preflight: str = field(default="on", metadata=flag(choices=PREFLIGHT))
    """'on': before any data is read, every rank runs one forward, backward and optimizer step of a
    synthetic worst-case micro-batch at the budget (max_tokens tokens as one sample and packed; a
    vision model's largest images, and its largest clips where it takes videos; under over_cap
    sequence_parallel a rank's slice of the longest sample its largest group holds), which changes
    no weight, reports its peak memory and time, and stops the run if it does not fit, naming the
    largest budget that does; needed by max_tokens auto. 'off': skip it."""
    memory_fraction: float = 0.9
    """The worst-case step may peak at this share of the smallest rank's device memory (GPU), or
    of the memory available to this machine's ranks (CPU)."""
    memory_limit_mb: int | None = None
    """A lower cap on the worst-case step's peak, in MiB (a shared GPU, headroom): on a GPU the
    device memory allocated, on the CPU how much the step grows the resident memory."""

    def __post_init__(self) -> None:
        check(self.preflight in PREFLIGHT, f"--preflight must be one of {PREFLIGHT}, got {self.preflight!r}")
        check_number("--memory_fraction", self.memory_fraction, 0, 1)
        check(self.memory_fraction > 0, "--memory_fraction must be > 0")
        check_optional_int("--memory_limit_mb", self.memory_limit_mb, 1)


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
    preflight: PreflightSettings = field(default_factory=PreflightSettings)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)

    def __post_init__(self) -> None:
        preference = self.objective.is_preference
        split = self.model.sequence_parallel_size > 1 or self.batching.over_cap == "sequence_parallel"
        check(not preference or not split,
              f"--objective {self.objective.objective} trains each pair whole on one rank: sequence parallelism "
              "(--sequence_parallel_size, over_cap sequence_parallel) is for next-token loss; use over_cap truncate "
              "or drop")
        check(not preference or self.batching.policy not in ("gmt", "bmt"),  # (fixed ignores max_tokens anyway)
              padded_refusal(self.objective.objective, f"policy {self.batching.policy!r} pads its micro-batches"))
        check(not preference or self.objective.reference_for(lora=self.model.lora is not None) != "adapter"
              or self.model.lora is not None,
              f"--objective {self.objective.objective} --reference adapter: the reference is the base model under a "
              "LoRA adapter; train with --lora, or use --reference precompute (the initial weights' log-probs, "
              "computed before the first step) or data (the records' ref_chosen_logps / ref_rejected_logps)")
        check(not preference or not self.data.streaming
              or self.objective.reference_for(lora=self.model.lora is not None) != "precompute",
              f"--objective {self.objective.objective} --reference precompute scores every record of the training data "
              "once, by its index, before the first step, and --streaming data has no stable index: give the records "
              "ref_chosen_logps / ref_rejected_logps (--reference data), or train LoRA (--lora: --reference adapter)")
        auto = [name for name in ("max_tokens", "max_patches") if getattr(self.batching, name) == "auto"]
        check(not auto or self.preflight.preflight == "on",
              f"{' and '.join(auto)} auto is measured by the preflight: drop --preflight off, or set a number")
        check(not self.data.streaming or self.batching.policy not in ("gmt", "bmt"),
              f"policy {self.batching.policy!r} sorts a rank's whole shard before it forms a micro-batch, and "
              "--streaming has no shard to hold whole: use policy 'odb' (or 'fixed')")
        check(self.model.sequence_parallel_size == 1 or self.batching.policy == "odb",
              f"--sequence_parallel_size splits packed rows; policy {self.batching.policy!r} trains padded ones: "
              "use policy 'odb'")
        check(not self.data.streaming or self.batching.mode == "join",
              "--streaming runs passes over its shards (mode 'join', --epochs); a quota needs every record "
              "reachable at any time: stop a streaming run with --max_steps instead")

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
