"""``odb export``: a saved checkpoint as a Hugging Face model folder, loadable with
``from_pretrained`` without odb.

    odb export runs/default/checkpoints/step200 runs/default/hf
    odb export runs/lora/checkpoints runs/lora/adapter --adapter_only

One process, no launcher: the weights come from the backend's files (DeepSpeed's fp32 master
weights at ZeRO 1-3, FSDP2's sharded checkpoint), the model, tokenizer and LoRA settings from the
checkpoint's run_config.json. LoRA runs are merged into the base weights unless --adapter_only
(LoRA on the LM head of a model with tied embeddings: the head is saved with its own weight,
tie_word_embeddings false).
"""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None, prog: str = "odb export") -> None:
    from odb.training.export import export_checkpoint

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("checkpoint", help="OUTPUT_DIR/checkpoints/<tag>, or OUTPUT_DIR/checkpoints (its latest tag)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--adapter_only", action="store_true",
                   help="LoRA runs: save the PEFT adapter (PeftModel.from_pretrained) instead of the merged model")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="of the saved weights (default: the run's precision: bf16/fp16 if enabled, else fp32)")
    p.add_argument("--model", default=None, help="the run's --model, where it is not where run_config.json says")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer folder, likewise")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, adapter_only=args.adapter_only, dtype=args.dtype,
                                model_path=args.model, tokenizer=args.tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    what = "adapter" if args.adapter_only else "model"
    print(f"wrote the {what} to {out}")
