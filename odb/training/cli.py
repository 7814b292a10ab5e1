"""The flags of ``launch/train.py``, checked before any process group is joined.

Everything that can be wrong with the inputs (a missing file, a model folder that does not
exist, a DeepSpeed config that contradicts odb) fails here, identically on every rank, with a
message that names the fix; nothing reaches a collective that could hang.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from odb.batching.config import OdbConfig, load_odb_config, read_json_object
from odb.data.processing import DataConfig, load_data_config
from odb.training.ds_config import load_ds_config, resolve_ds_config
from odb.data.formats import FORMATS

__all__ = ["TrainArgs", "parse_args"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class TrainArgs:
    args: argparse.Namespace
    odb: OdbConfig
    data: DataConfig
    ds_config: dict[str, Any]  # resolved: odb's batch values, "auto" precision filled in
    lora: dict[str, Any] | None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Fine-tune a causal LM with odb's online dynamic batching "
                                            "under DeepSpeed (deepspeed --num_gpus N launch/train.py ...)")
    p.add_argument("--deepspeed_config", default=str(ROOT / "configs" / "ds_zero2.json"),
                   help="DeepSpeed JSON; batch keys may be \"auto\" (odb fills them in)")
    p.add_argument("--odb_config", default=str(ROOT / "configs" / "odb.json"),
                   help="odb settings JSON (max_tokens, window, gas, mode, quota, over_cap, ...)")
    p.add_argument("--model", default=str(ROOT / "configs" / "tiny_model.json"),
                   help="a local HF model folder, or a model config JSON (random init)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the model folder, else data/tokenizer)")
    p.add_argument("--data", default=str(ROOT / "data" / "chat.jsonl"),
                   help="JSONL / JSON / Parquet file or folder: messages, ShareGPT or LLaVA records")
    p.add_argument("--data_config", default=None,
                   help="data settings JSON (format, train_on, augmentation, image sizes, strict)")
    p.add_argument("--data_format", choices=FORMATS, default=None, help="override the detected format")
    p.add_argument("--strict", action="store_true", default=None,
                   help="stop at the first bad record (file, line, reason) instead of skipping it")
    p.add_argument("--output_dir", default="runs/default")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_samples", type=int, default=None, help="use only the first N samples")
    p.add_argument("--max_steps", type=int, default=None, help="stop after N optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="default: the odb config's seed (0)")
    p.add_argument("--lora", nargs="?", const=str(ROOT / "configs" / "lora.json"), default=None,
                   help="train PEFT LoRA adapters (rank, alpha, targets from this JSON)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from OUTPUT_DIR/checkpoints (latest, or a tag such as step20)")
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (and at the end)")
    p.add_argument("--no_final_checkpoint", action="store_true", help="skip the checkpoint at the end")
    p.add_argument("--audit_ids", action="store_true",
                   help="write emitted_ids.rank<R>.jsonl: the dataset indices of every micro-batch")
    p.add_argument("--num_workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--prefetch_factor", type=int, default=4)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--report_to", choices=("none", "wandb"), default="none",
                   help="also log metrics to Weights & Biases (rank 0, one run; WANDB_MODE=offline works)")
    p.add_argument("--wandb_project", default="odb")
    p.add_argument("--run_name", default=None, help="W&B run name (default: the output_dir's name)")
    p.add_argument("--wandb_tags", default="", help="comma-separated W&B tags")
    p.add_argument("--dist_timeout_s", type=int, default=600, help="timeout of every collective")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by launchers
    return p


def _need_file(path: str, what: str, fix: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} {p} does not exist; {fix}")
    return p


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    args = _parser().parse_args(argv)
    for name in ("epochs",):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    odb = load_odb_config(_need_file(args.odb_config, "odb config", "pass --odb_config configs/odb.json"),
                          seed=args.seed)
    args.seed = odb.seed  # one seed: sample order, augmentation, random init
    import torch

    # launchers (deepspeed, torchrun, srun via our sbatch) set WORLD_SIZE before we start
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ds_config = resolve_ds_config(load_ds_config(args.deepspeed_config), gas=odb.gas, world_size=world_size,
                                  use_bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                                  source=args.deepspeed_config)
    model = _need_file(args.model, "model", "pass a local HF model folder (with config.json) or a model "
                       "config JSON such as configs/tiny_model.json")
    if model.is_dir() and not (model / "config.json").is_file():
        raise FileNotFoundError(f"model folder {model} has no config.json; pass a Hugging Face model "
                                "folder (save_pretrained) or a config JSON")
    if args.tokenizer is None:
        args.tokenizer = str(model) if model.is_dir() and (model / "tokenizer_config.json").is_file() \
            else str(ROOT / "data" / "tokenizer")
    _need_file(args.tokenizer, "tokenizer folder", "pass --tokenizer with a folder from save_pretrained")
    _need_file(args.data, "data path", "pass --data data/chat.jsonl, or your own file or folder")
    data = load_data_config(args.data_config, format=args.data_format, strict=args.strict)
    lora = None
    if args.lora:
        lora = read_json_object(args.lora, "LoRA config", "pass --lora configs/lora.json")
    if args.resume and not (Path(args.output_dir) / "checkpoints").is_dir():
        raise FileNotFoundError(f"--resume: no checkpoints in {Path(args.output_dir) / 'checkpoints'}; "
                                "resume with the --output_dir of the run that saved them")
    return TrainArgs(args=args, odb=odb, data=data, ds_config=ds_config, lora=lora)
