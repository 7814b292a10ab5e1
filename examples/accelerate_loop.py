#!/usr/bin/env python
"""odb in an Accelerate loop of one's own: the bundled tiny model on the bundled chat data.

    torchrun --nproc_per_node 2 examples/accelerate_loop.py --output_dir runs/acc --audit_ids --max_samples 200

The run writes what odb's own trainer writes (metrics.jsonl, summary.json, with --audit_ids
emitted_ids.rank<R>.jsonl); with --save_steps N, Accelerate's state and odb's in
OUTPUT_DIR/checkpoints/stepN, from which --resume continues.
"""

from pathlib import Path

import torch
from accelerate import Accelerator
from common import odb_settings, parser

from odb.integrations.accelerate import backward, odb_run, set_lr
from odb.training.model.build import build_model, load_tokenizer


def parse():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--resume", default=None, help="a checkpoint folder to continue from")
    return p.parse_args()


def main() -> None:
    args = parse()
    settings = odb_settings(args, log_steps=10)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = load_tokenizer(args.tokenizer)
    model = build_model(args.model, seed=settings.batching.seed, vocab_size=len(tokenizer))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    run = odb_run(accelerator, model, settings, lr=args.lr, output_dir=args.output_dir, epochs=args.epochs,
                  resuming=bool(args.resume))
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
