"""odb settings: one frozen, keyword-only dataclass, validated on construction.

DeepSpeed keeps its own JSON; odb's settings live in their own file (``configs/odb.json``) and
are loaded strictly (JSON or YAML, or a recipe's inline mapping): an unknown key is an error that
lists the known keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from odb.settings import ConfigSource, check_bool, check_int, check_number, flag, load_json_config

__all__ = ["AUTO", "OdbConfig", "gas_for_tokens", "load_odb_config"]

_POLICIES = ("odb", "fixed", "gmt", "bmt")
_MODES = ("join", "quota")
_OVER_CAP = ("truncate", "drop", "error", "sequence_parallel")
_SHARDING = ("dynamic", "static")
_COST_MODELS = ("fit", "manual")
AUTO = "auto"
"""``max_tokens`` / ``max_patches``: measured at start-up (the trainer's preflight), not written."""


def _budget(value: str) -> int | str:
    """A budget flag's value: an integer, or 'auto'."""
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"a budget must be an integer or 'auto', got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class OdbConfig:
    """How odb forms micro-batches.

    Where the fields are set: every field is a key of the same name in odb's own JSON file
    (``configs/odb.json``; the trainer's ``--odb_config``), read strictly (:func:`load_odb_config`). The
    trainer's flag of the same name overrides each (``--max_tokens 16384``, ``--seed 3``) but
    ``pad_rows``, which the trainer sets itself (a model that cannot pack); it may also lower
    ``max_tokens`` (room for a vision model's blank image).
    ``tools/bench/bench_batching.py`` takes some of them as dashed flags (``--max-tokens``, ``--window``,
    ``--gas``, ``--policy``, ``--batch-size``, ``--mode``, ``--quota``, ``--over-cap``, ``--seed``).
    Errors name a field as ``--<field>``.
    """

    max_tokens: int | str = field(default=8192, metadata=flag(parse=_budget))
    """Hard cap on tokens in one micro-batch (visual tokens included); 'auto': the largest whose
    worst-case step fits the device's memory, measured at start-up (the trainer's preflight)."""
    window: int = 1024
    """Processed samples a rank holds while packing (K)."""
    gas: int = 1
    """Micro-batches per optimizer step on every rank (gradient accumulation steps)."""
    global_batch_tokens: int | None = None
    """Tokens an optimizer step should carry over all ranks: the trainer derives gas from it at
    start (and at a resume on another number of ranks), :func:`gas_for_tokens`, and writes it
    where gas was (run_config.json, summary.json, DeepSpeed's config)."""
    mode: str = "join"
    """'join': every sample exactly once per epoch; 'quota': stop at a global sample count."""
    quota: int | None = None
    """Samples to train in quota mode (e.g. epochs x dataset size)."""
    over_cap: str = "truncate"
    """A sample longer than max_tokens: 'truncate' it, 'drop' it (counted), raise an 'error', or
    train it whole on a group of ranks together, 'sequence_parallel' (up to the largest group's
    ranks x max_tokens; a longer one is truncated to that, counted)."""
    max_sp: int = 8
    """over_cap 'sequence_parallel': the largest group that trains one long sample together; the
    groups are the powers of two up to it that divide the number of ranks."""
    max_patches: int | str | None = field(default=None, metadata=flag(parse=_budget))
    """Optional cap on vision-encoder patches in one micro-batch; 'auto': those of the preflight's
    worst case at the budget (the largest images, as many as half its tokens hold; where the run
    takes videos, the largest clips, as many as all its tokens hold)."""
    cost_model: str = "fit"
    """How ranks are balanced: 'fit': attn_coef and patch_coef fitted from the run's own
    micro-batch times, from the values given until the first fit (plans then depend on the
    machine's timings); 'manual': the values given, so plans depend on the seed and data alone."""
    attn_coef: float = 0.0
    """Cost = tokens + attn_coef * sum(sequence_tokens^2) + patch_coef * patches (a preference pair: its
    chosen and rejected sequences apart)."""
    patch_coef: float = 0.0
    """The cost of one vision-encoder patch (see attn_coef)."""
    a2a_coef: float = 0.0
    """over_cap 'sequence_parallel': what the all-to-all adds per token of a rank's slice of a long
    sample, in tokens (fitted with cost_model 'fit')."""
    min_fill: float = 0.99
    """A bin at least this full (fraction of max_tokens) may be trained now; emptier ones wait."""
    max_carry: float = 0.5
    """At most this fraction of the window waits for a better bin; the fullest of the rest go."""
    lookahead: int = 64
    """Indices handed to a rank beyond its window, so that its DataLoader never runs dry."""
    sharding: str = "dynamic"
    """'dynamic': one shared seeded index stream dealt to the least-loaded rank each round;
    'static': fixed strided shards, like torch's DistributedSampler."""
    policy: str = "odb"
    """'odb' (packed, online) or a padded baseline: 'fixed', 'gmt', 'bmt'."""
    batch_size: int = 8
    """Samples per micro-batch for the 'fixed' baseline."""
    bucket_size: int = 4096
    """Samples per sorting bucket for the 'bmt' baseline."""
    pad_rows: bool = False
    """Set by the trainer when the model cannot pack; bins then hold len(samples) * longest <=
    max_tokens and are marked padded (the baselines pad anyway)."""
    seed: int = 0
    """The run's one seed: the sample order of every epoch, augmentation, a random init, LoRA's init."""

    def __post_init__(self) -> None:
        if self.max_tokens != AUTO:
            check_int("--max_tokens", self.max_tokens, 1)  # (or 'auto')
        for name, minimum in (("window", 1), ("gas", 1), ("batch_size", 1), ("bucket_size", 1), ("lookahead", 0),
                              ("seed", 0), ("max_sp", 1)):
            check_int(f"--{name}", getattr(self, name), minimum)
        if self.window < self.gas:
            raise ValueError(f"--window ({self.window}) must be >= --gas ({self.gas}): a rank needs GAS "
                             "samples at hand to fill a step without dummies")
        for name, allowed in (("mode", _MODES), ("over_cap", _OVER_CAP), ("sharding", _SHARDING),
                              ("policy", _POLICIES), ("cost_model", _COST_MODELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.mode == "quota":
            if self.quota is None:
                raise ValueError("--mode quota needs --quota >= 1 (samples to train), got None")
            check_int("--quota", self.quota, 1)
        elif self.quota is not None:
            raise ValueError("--quota is only used with --mode quota; drop it or set --mode quota")
        if self.global_batch_tokens is not None:
            check_int("--global_batch_tokens", self.global_batch_tokens, 1)
        if self.max_patches not in (None, AUTO):
            check_int("--max_patches", self.max_patches, 1)  # (or null: no cap, or 'auto')
        for name in ("attn_coef", "patch_coef", "a2a_coef"):
            check_number(f"--{name}", getattr(self, name), 0)
        for name in ("min_fill", "max_carry"):
            check_number(f"--{name}", getattr(self, name), 0, 1)
        check_bool("--pad_rows", self.pad_rows)
        self._check_policy()

    def _check_policy(self) -> None:
        """Combinations a baseline policy cannot run (they would never form a micro-batch)."""
        if self.policy == "fixed" and self.window < self.batch_size:
            raise ValueError(f"--policy fixed needs --window >= --batch_size (a rank must hold a whole batch), "
                             f"got window {self.window} < batch_size {self.batch_size}; raise --window or "
                             "lower --batch_size")
        if self.policy in ("gmt", "bmt") and self.mode == "quota":
            raise ValueError(f"--policy {self.policy} does not support --mode quota (it needs every length of "
                             "its shard before its first step, and quota mode streams the data over and over); "
                             "use --mode join with --epochs, or --policy odb / fixed for quota mode")
        if self.over_cap == "sequence_parallel" and (self.policy != "odb" or self.mode != "join" or self.pad_rows):
            raise ValueError("--over_cap sequence_parallel splits a long sample's packed row between ranks: it needs "
                             "--policy odb, --mode join and a model odb can pack; got policy "
                             f"{self.policy!r}, mode {self.mode!r}" + (", padded rows" if self.pad_rows else "")
                             + " (or set --over_cap truncate)")

    @property
    def is_resolved(self) -> bool:
        """No budget is left 'auto' (the trainer's preflight resolves them before anything plans)."""
        return AUTO not in (self.max_tokens, self.max_patches)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]



def gas_for_tokens(global_batch_tokens: int, ranks: int, max_tokens: int, fill: float) -> int:
    """The gas whose optimizer step carries about ``global_batch_tokens`` tokens on ``ranks``
    data-parallel ranks, each micro-batch holding ``fill`` x ``max_tokens`` real tokens (the
    packer trains bins at least ``min_fill`` full): the nearest, at least 1."""
    return max(1, round(global_batch_tokens / (ranks * max_tokens * fill)))


def load_odb_config(path: ConfigSource, **overrides: Any) -> OdbConfig:
    """Reads an odb JSON or YAML file (or a recipe's inline mapping) strictly; ``overrides`` (not
    None) win over the file."""
    values = load_json_config(path, known=OdbConfig.field_names(), what="odb config",
                              fix="pass --odb_config configs/odb.json or a file of your own")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return OdbConfig(**values)
