#!/usr/bin/env python
"""A saved checkpoint as a Hugging Face model folder, loadable with ``from_pretrained`` without odb.

    python tools/export_hf.py runs/default/checkpoints/step200 runs/default/hf
    python tools/export_hf.py runs/lora/checkpoints runs/lora/adapter --adapter_only

One process, no launcher: the weights come from DeepSpeed's files (fp32 master weights at ZeRO
1-3), the model, tokenizer and LoRA settings from the checkpoint's run_config.json. LoRA runs are
merged into the base weights unless --adapter_only (LoRA on the LM head of a model with tied
embeddings: the head is saved with its own weight, tie_word_embeddings false).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from odb.training.export import export_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="OUTPUT_DIR/checkpoints/<tag>, or OUTPUT_DIR/checkpoints (its latest tag)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--adapter_only", action="store_true",
                   help="LoRA runs: save the PEFT adapter (PeftModel.from_pretrained) instead of the merged model")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="of the saved weights (default: the run's precision: bf16/fp16 if enabled, else fp32)")
    p.add_argument("--model", default=None, help="the run's --model, where it is not where run_config.json says")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer folder, likewise")
    args = p.parse_args()
    try:
        out = export_checkpoint(args.checkpoint, args.out, adapter_only=args.adapter_only, dtype=args.dtype,
                                model_path=args.model, tokenizer=args.tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"export_hf: {exc}") from None
    what = "adapter" if args.adapter_only else "model"
    print(f"wrote the {what} to {out}")


if __name__ == "__main__":
    main()
