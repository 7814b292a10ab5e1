#!/usr/bin/env python
"""odb inside Hugging Face ``Trainer``: the bundled tiny model on the bundled chat data.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --output_dir runs/hf --audit_ids --max_samples 200
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed configs/ds_zero3.json --output_dir runs/hf3

The run writes what odb's own trainer writes (metrics.jsonl, summary.json, with --audit_ids
emitted_ids.rank<R>.jsonl) and the Trainer's own checkpoints; the final model goes to OUTPUT_DIR/hf.
With --trl, TRL's ``SFTTrainer`` through ``with_odb(SFTTrainer)``, which takes the same ``odb=``
argument.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from odb.batching.config import load_odb_config  # noqa: E402
from odb.integrations import OdbSettings  # noqa: E402
from odb.integrations.hf import OdbTrainer, with_odb  # noqa: E402
from odb.training.config import DataSettings  # noqa: E402
from odb.training.model import build_model, load_tokenizer  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default=str(REPO / "configs" / "tiny_model.json"),
                   help="a model folder, or a model config JSON (random init)")
    p.add_argument("--tokenizer", default=str(REPO / "data" / "tokenizer"))
    p.add_argument("--data", default=str(REPO / "data" / "chat.jsonl"))
    p.add_argument("--max_samples", type=int, default=None)
    p.add_argument("--odb_config", default=str(REPO / "configs" / "odb.json"), help="odb's batching settings")
    p.add_argument("--cost_model", default=None, choices=("fit", "manual"))
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed config JSON (default: DDP)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=-1)
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps (odb's gas)")
    p.add_argument("--lr", type=float, default=1e-3, help="the bundled random-init model's (a real model: 2e-5)")
    p.add_argument("--save_steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output_dir")
    p.add_argument("--audit_ids", action="store_true")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer (with_odb(SFTTrainer)) instead of Trainer")
    return p.parse_args()


def main() -> None:
    args = parse()
    overrides = {"cost_model": args.cost_model} if args.cost_model else {}
    batching = load_odb_config(args.odb_config, **overrides)
    tokenizer = load_tokenizer(args.tokenizer)
    random_init = Path(args.model).is_file()
    if random_init:  # whole, from the seed, before DeepSpeed's settings are known: the numbers odb's own trainer
        model = build_model(args.model, seed=batching.seed, vocab_size=len(tokenizer))  # draws (ZeRO-3 included)
    arguments, trainer_class = TrainingArguments, OdbTrainer
    if args.trl:
        from trl import SFTConfig, SFTTrainer

        # (TRL's defaults: bf16 and gradient checkpointing on; the bundled run keeps fp32 and none)
        arguments, trainer_class = partial(SFTConfig, gradient_checkpointing=False), with_odb(SFTTrainer)
    training = arguments(
        output_dir=args.output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=args.gas,
        num_train_epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0.03,
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, deepspeed=args.deepspeed,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        logging_steps=10, report_to=[], seed=batching.seed, disable_tqdm=True)
    if not random_init:  # a model folder after TrainingArguments: under ZeRO-3 transformers loads it partitioned
        if args.deepspeed:  # (over the ranks: DeepSpeed's process group first, which Accelerate joins on GPUs only)
            import deepspeed

            deepspeed.init_distributed()
        model = build_model(args.model, seed=batching.seed, vocab_size=len(tokenizer))
    odb = OdbSettings(data=DataSettings(path=args.data, max_samples=args.max_samples), batching=batching,
                      tokenizer=args.tokenizer, audit_ids=args.audit_ids)
    trainer = trainer_class(model=model, args=training, processing_class=tokenizer, odb=odb)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(str(Path(args.output_dir) / "hf"))


if __name__ == "__main__":
    main()
