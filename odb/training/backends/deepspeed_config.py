"""DeepSpeed's own JSON, as odb reads it: loaded strictly (:func:`load_ds_config`), its ``"auto"``
batch keys filled in from odb's GAS and the world size, contradictions with odb refused
(:func:`resolve_ds_config`), and what the run reads of it (precision, ZeRO stage)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from odb.settings import ConfigSource, read_json_object

if TYPE_CHECKING:
    pass

__all__ = ["is_zero3", "load_ds_config", "resolve_ds_config", "training_dtype"]


def load_ds_config(path: ConfigSource) -> dict[str, Any]:
    return read_json_object(path, "DeepSpeed config",
                            "pass --deepspeed_config configs/ds_zero2.json (or ds_zero0/1/3.json)")


def resolve_ds_config(config: dict[str, Any], *, gas: int, world_size: int, use_bf16: bool,
                      source: str = "DeepSpeed config") -> dict[str, Any]:
    """A copy of ``config`` with odb's values for the batch keys and ``"auto"`` precision."""
    out = json.loads(json.dumps(config))
    wanted = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
              "train_batch_size": gas * world_size}
    why = {"train_micro_batch_size_per_gpu": "odb packs each micro-batch into one row",
           "gradient_accumulation_steps": f"odb's gas is {gas} (set 'gas' in the odb config instead)",
           "train_batch_size": f"odb runs world_size x gas = {world_size} x {gas} packed micro-batches "
                               "per step, each holding a varying number of samples"}
    for key, value in wanted.items():
        given = out.get(key, "auto")
        if given != "auto" and (given != value or isinstance(given, bool)):
            raise ValueError(f"{source}: {key}={given!r} cannot hold: {why[key]}; set it to \"auto\"")
        out[key] = value
    if "scheduler" in out:
        raise ValueError(f"{source}: remove \"scheduler\": odb sets the learning rate by progress "
                         "(samples trained over the planned total), since the number of steps is "
                         "not known up front; use --lr and --warmup_ratio")
    _check_blocks(out, source)
    for precision in ("bf16", "bfloat16", "fp16"):
        block = out.get(precision)
        if block is not None and block.get("enabled") == "auto":
            block["enabled"] = use_bf16 if precision != "fp16" else False
    return out


def _check_blocks(config: dict[str, Any], source: str) -> None:
    """The blocks odb itself reads (precision, ZeRO stage) have the shape it reads them in; DeepSpeed
    checks the rest of its JSON itself."""
    for precision in ("bf16", "bfloat16", "fp16"):
        if precision not in config:
            continue
        block = config[precision]
        if not isinstance(block, dict):
            raise ValueError(f"{source}: \"{precision}\" must be an object such as {{\"enabled\": \"auto\"}}, "
                             f"got {block!r}")
        enabled = block.get("enabled", False)
        if not (isinstance(enabled, bool) or enabled == "auto"):
            raise ValueError(f"{source}: \"{precision}\": {{\"enabled\": ...}} must be true, false or \"auto\", "
                             f"got {enabled!r}")
    if "zero_optimization" in config:
        block = config["zero_optimization"]
        stage = block.get("stage", 0) if isinstance(block, dict) else None
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"{source}: \"zero_optimization\" must be an object with a \"stage\" of 0, 1, 2 or 3, "
                             f"got {block!r}")


def training_dtype(ds_config: Mapping[str, Any] | None) -> torch.dtype:
    """DeepSpeed's training precision: bf16 or fp16 where its (resolved) JSON enables one, else fp32."""
    if ds_config is not None:
        for keys, dtype in ((("bf16", "bfloat16"), torch.bfloat16), (("fp16",), torch.float16)):
            if any((ds_config.get(key) or {}).get("enabled") is True for key in keys):
                return dtype
    return torch.float32


def is_zero3(ds_config: Mapping[str, Any] | None) -> bool:
    return ds_config is not None and (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3


def zero_stage_of(ds_config: Mapping[str, Any]) -> int:
    return (ds_config.get("zero_optimization") or {}).get("stage", 0)
