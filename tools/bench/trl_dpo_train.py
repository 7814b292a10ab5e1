#!/usr/bin/env python
"""TRL's own DPOTrainer on the pairs of tools/bench/bench_trl_dpo.py, one process per rank under
torchrun (gloo on CPU), as a user of TRL runs it:

    torchrun --nproc_per_node 2 --master_port 29731 tools/bench/trl_dpo_train.py --model MODEL_DIR \\
        --train train.jsonl --eval eval.jsonl --out OUT --batch_size 4 --epochs 3 --eval_steps 10 \\
        --beta 0.1 --lr 3e-4

``DPOConfig``: loss ``sigmoid``, ``precompute_ref_log_probs`` (the initial weights' log-probs of
every train and eval pair, one pass before training), AdamW (``adamw_torch``, no weight decay),
gradient clipping 1.0, warmup over ``--warmup_ratio`` of the steps then cosine to a tenth of the
learning rate (``cosine_with_min_lr``), fp32, no truncation (``max_length=None``), TRL's collator
(``DataCollatorForPreference``: a batch of B pairs is 2B rows, right-padded to its longest).

What it measures, beside TRL's own log (``log_history``, with ``eval_rewards/accuracies``):

- each optimizer step's wall time on rank 0, from the previous step's end (the training loop's
  start for the first), less any evaluation in between (:class:`StepClock`);
- each evaluation's wall time (:meth:`TimedDPOTrainer.evaluate`);
- the padding of the training batches the model took: the attention mask's ones (real tokens) and
  its size (materialized tokens), per rank, counted in ``compute_loss`` of the training steps only.

Everything lands in ``OUT/trl_run.json`` (rank 0 gathers the ranks' counts), with each train pair's
lengths as TRL tokenized it (both sequences, then both completions) for the caller to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl import DPOConfig, DPOTrainer  # noqa: E402

__all__ = ["StepClock", "TimedDPOTrainer"]


class StepClock(TrainerCallback):
    """Each optimizer step's wall time, from the previous step's end, less the evaluations since."""

    def __init__(self) -> None:
        self.last = 0.0
        self.eval_s = 0.0  # evaluation time since the last step's end
        self.step_s: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_s.append(now - self.last - self.eval_s)
        # (the evaluation of this step runs after on_step_end: it is taken off the next step's time)
        self.last, self.eval_s = now, 0.0


class TimedDPOTrainer(DPOTrainer):
    """DPOTrainer that times its evaluations and counts the padding of its training batches."""

    def __init__(self, *args, clock: StepClock, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.evals: list[dict] = []  # {"step", "eval_s"} per evaluation
        self.real_tokens = 0
        self.materialized_tokens = 0
        self.rows = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:  # a training batch, as the collator built it: 2B rows padded to the longest
            mask = inputs["attention_mask"]
            self.real_tokens += int(mask.sum())
            self.materialized_tokens += mask.numel()
            self.rows += mask.shape[0]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def evaluate(self, *args, **kwargs):
        began = time.perf_counter()
        metrics = super().evaluate(*args, **kwargs)
        seconds = time.perf_counter() - began
        self.clock.eval_s += seconds
        self.evals.append({"step": self.state.global_step, "eval_s": round(seconds, 4)})
        return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the initial weights and tokenizer (a folder)")
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--batch_size", type=int, required=True, help="pairs a rank's batch")
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--eval_steps", type=int, required=True)
    parser.add_argument("--beta", type=float, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--warmup_ratio", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = DPOConfig(
        output_dir=str(args.out), per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size, num_train_epochs=args.epochs, learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=args.warmup_ratio, optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0,
        beta=args.beta, loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=None,
        eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, ddp_backend="gloo", bf16=False, seed=args.seed, data_seed=args.seed,
        disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_dataset("json", data_files={"train": args.train, "eval": args.eval})
    clock = StepClock()
    trainer = TimedDPOTrainer(model=model, args=config, train_dataset=data["train"], eval_dataset=data["eval"],
                              processing_class=tokenizer, callbacks=[clock], clock=clock)
    # each train pair as TRL tokenized it: the two sequences' lengths, then the two completions'
    tokenized = trainer.train_dataset
    lengths = [[len(p) + len(c), len(p) + len(r), len(c), len(r)]
               for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])]
    began = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - began
    counts = torch.tensor([trainer.real_tokens, trainer.materialized_tokens, trainer.rows], dtype=torch.int64)
    dist.all_reduce(counts)
    if trainer.is_world_process_zero():
        real, materialized, rows = counts.tolist()
        out = {"world_size": dist.get_world_size(), "batch_size": args.batch_size, "step_s": clock.step_s,
               "evals": trainer.evals, "loop_s": round(loop_s, 3), "real_tokens": real,
               "materialized_tokens": materialized, "rows": rows, "log_history": trainer.state.log_history,
               "lengths": lengths}
        (args.out / "trl_run.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
