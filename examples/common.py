"""What the examples share: the bundled model, tokenizer, data and odb settings as flags, and odb's
settings for the host from them (the examples put the repository on ``sys.path``)."""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from odb.batching.config import load_odb_config  # noqa: E402
from odb.data.mixture import is_plain_path, parse_sources  # noqa: E402
from odb.integrations import OdbSettings  # noqa: E402
from odb.training.config.settings import DataSettings  # noqa: E402


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every example takes; each adds its host's own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default=str(REPO / "configs" / "tiny_model.json"),
                   help="a model folder, or a model config JSON (random init)")
    p.add_argument("--tokenizer", default=str(REPO / "data" / "tokenizer"))
    p.add_argument("--data", nargs="+", default=[str(REPO / "data" / "chat.jsonl")],
                   help="a file or folder, or named sources NAME=PATH:WEIGHT (a weighted mixture)")
    p.add_argument("--mix_epoch", default="all", choices=("all", "first"), help="a weighted mixture's epoch")
    p.add_argument("--max_samples", type=int, default=None)
    p.add_argument("--odb_config", default=str(REPO / "configs" / "odb.json"), help="odb's batching settings")
    p.add_argument("--cost_model", default=None, choices=("fit", "manual"))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3, help="the bundled random-init model's (a real model: 2e-5)")
    p.add_argument("--save_steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    p.add_argument("--audit_ids", action="store_true")
    return p


def odb_settings(args: argparse.Namespace, **extra) -> OdbSettings:
    """odb's settings from the flags: the batching file (with --cost_model over it) and the data."""
    overrides = {"cost_model": args.cost_model} if args.cost_model else {}
    sources = () if is_plain_path(args.data) else parse_sources(args.data)
    data = DataSettings(path=" ".join(args.data), sources=sources, mix_epoch=args.mix_epoch,
                        max_samples=args.max_samples)
    return OdbSettings(data=data,
                       batching=load_odb_config(args.odb_config, **overrides), tokenizer=args.tokenizer,
                       audit_ids=args.audit_ids, **extra)
