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
        if given != "auto" and given != value:
            raise ValueError(f"{source}: {key}={given!r} cannot hold: {why[key]}; set it to \"auto\"")
        out[key] = value
    if "scheduler" in out:
        raise ValueError(f"{source}: remove \"scheduler\": odb sets the learning rate by progress "
                         "(samples trained over the planned total), since the number of steps is "
                         "not known up front; use --lr and --warmup_ratio")
    for precision in ("bf16", "fp16"):
        block = out.get(precision)
        if isinstance(block, dict) and block.get("enabled") == "auto":
            block["enabled"] = use_bf16 if precision == "bf16" else False
    return out
