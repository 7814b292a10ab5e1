#!/usr/bin/env python
"""odb in an Accelerate loop of one's own: the bundled tiny model on the bundled chat data.

    torchrun --nproc_per_node 2 examples/accelerate_loop.py --output_dir runs/acc --audit_ids --max_samples 200

The run writes what odb's own trainer writes (metrics.jsonl, summary.json, with --audit_ids
emitted_ids.rank<R>.jsonl); with --save_steps N, Accelerate's state and odb's in
OUTPUT_DIR/checkpoints/stepN, from which --resume continues.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from odb.batching.config import load_odb_config  # noqa: E402
from odb.integrations import OdbSettings  # noqa: E402
from odb.integrations.accelerate import backward, odb_run, set_lr  # noqa: E402
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
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3, help="the bundled random-init model's (a real model: 2e-5)")
    p.add_argument("--save_steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="a checkpoint folder to continue from")
    p.add_argument("--audit_ids", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse()
    overrides = {"cost_model": args.cost_model} if args.cost_model else {}
    batching = load_odb_config(args.odb_config, **overrides)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = load_tokenizer(args.tokenizer)
    model = build_model(args.model, seed=batching.seed, vocab_size=len(tokenizer))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    settings = OdbSettings(data=DataSettings(path=args.data, max_samples=args.max_samples), batching=batching,
                           tokenizer=args.tokenizer, audit_ids=args.audit_ids, log_steps=10)
    run = odb_run(accelerator, model, settings, lr=args.lr, output_dir=args.output_dir, epochs=args.epochs)
    out = Path(args.output_dir)
    if args.resume:
        accelerator.load_state(args.resume)
        run.load_states(args.resume)
    try:
        for step in run.steps():
            set_lr(optimizer, step.lr)
            for micro in step.micro_batches:
                backward(accelerator, model, micro)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step.end()
            done = run.parts.telemetry.steps_done
            if args.save_steps and done % args.save_steps == 0:
                folder = out / "checkpoints" / f"step{done}"
                accelerator.save_state(str(folder))
                run.save_states(folder)
        run.finish()
    except BaseException as error:
        run.close(error)
        raise
    run.close()
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(out / "hf", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)


if __name__ == "__main__":
    main()
