"""DeepSpeed's JSON stays DeepSpeed's; odb fills in its "auto" values and refuses contradictions.

odb packs each micro-batch into one row, so DeepSpeed sees ``train_micro_batch_size_per_gpu = 1``,
``gradient_accumulation_steps = GAS`` (odb's) and ``train_batch_size = GAS * world`` packed rows per
step; the samples in them vary from step to step. ``"auto"`` resolves to those; a fixed value
that disagrees is an error naming the fix, raised before any process group is joined.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from odb.batching.config import read_json_object

__all__ = ["load_ds_config", "resolve_ds_config"]


def load_ds_config(path: str | Path) -> dict[str, Any]:
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
