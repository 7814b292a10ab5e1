#!/usr/bin/env python
"""odb inside Hugging Face ``Trainer``: the bundled tiny model on the bundled chat data.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --output_dir runs/hf --audit_ids --max_samples 200
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed configs/ds_zero3.json --output_dir runs/hf3

The run writes what odb's own trainer writes (metrics.jsonl, summary.json, with --audit_ids
emitted_ids.rank<R>.jsonl) and the Trainer's own checkpoints; the final model goes to OUTPUT_DIR/hf.
With --trl, TRL's ``SFTTrainer`` through ``with_odb(SFTTrainer)``, which takes the same ``odb=``
argument. With --dpo, TRL's ``DPOTrainer`` through ``with_odb(DPOTrainer)`` on preference records
(--data data/preference.jsonl), a full fine-tune whose ``ref_model`` is the model as it starts:

    torchrun --nproc_per_node 2 examples/hf_trainer.py --dpo --data data/preference.jsonl --output_dir runs/dpo
"""

from functools import partial
from pathlib import Path

import torch
from common import odb_settings, parser
from transformers import TrainingArguments

from odb.integrations.hf import OdbTrainer, with_odb
from odb.training.model.build import build_model, load_tokenizer


def parse():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed config JSON (default: DDP)")
    p.add_argument("--max_steps", type=int, default=-1)
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps (odb's gas)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output_dir")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer (with_odb(SFTTrainer)) instead of Trainer")
    p.add_argument("--dpo", action="store_true", help="TRL's DPOTrainer (with_odb(DPOTrainer)) on preference records")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta (with --dpo)")
    return p.parse_args()


def main() -> None:
    args = parse()
    odb = odb_settings(args)
    batching = odb.batching
    tokenizer = load_tokenizer(args.tokenizer)
    random_init = Path(args.model).is_file()
    def initial():
        return build_model(args.model, seed=batching.seed, vocab_size=len(tokenizer))

    if random_init:  # whole, from the seed, before DeepSpeed's settings are known: the numbers odb's own trainer
        model = initial()  # draws (ZeRO-3 included)
    arguments, trainer_class, extra = TrainingArguments, OdbTrainer, {}
    if args.dpo:
        from trl import DPOConfig, DPOTrainer

        # (odb's own --objective dpo of a full fine-tune: the reference is the initial weights, here a copy)
        arguments = partial(DPOConfig, gradient_checkpointing=False, beta=args.beta, loss_type="sigmoid")
        trainer_class = with_odb(DPOTrainer)
    elif args.trl:
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
        model = initial()
    if args.dpo:
        extra["ref_model"] = initial()
    trainer = trainer_class(model=model, args=training, processing_class=tokenizer, odb=odb, **extra)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(str(Path(args.output_dir) / "hf"))


if __name__ == "__main__":
    main()
