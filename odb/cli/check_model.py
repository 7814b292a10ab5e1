"""``odb check-model``: that odb trains your model as the model itself would, before a long run on it.

    odb check-model /models/Qwen3-30B-A3B --data my_sft.jsonl --samples 8
    odb check-model /models/Qwen2.5-VL-7B-Instruct --data vl.jsonl --data_config data.json --json

On the model's own weights and the first samples of your data, odb's packed micro-batches are
compared with the model run one sample at a time through its own attention (eager or sdpa) and its
own loss (``labels=``, the router loss of an MoE model included): logits, loss, gradients, the
label runs of the first sample, and a VL model's image processor (odb/training/check_model.py
says how). Exit 0 when everything is within tolerance; exit 1 with the reasons when anything is
off, or when odb refuses the model (and why). ``--json`` prints one JSON object instead of text.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["main"]


def main(argv: list[str] | None = None, prog: str = "odb check-model") -> int:
    import torch

    from odb.data.processing import load_data_config
    from odb.training.check_model import check_model
    from odb.training.launch.flags import FileDefaults

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("model", help="a Hugging Face model folder (or a model config JSON: random weights)")
    parser.add_argument("--data", default=str(FileDefaults.bundled().data),
                        help="records to check on (default: the bundled chat data)")
    parser.add_argument("--data_config", default=None, help="the run's data settings JSON or YAML")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    parser.add_argument("--samples", type=int, default=8, help="samples packed for the logits comparison")
    parser.add_argument("--loss_samples", type=int, default=3, help="samples whose loss and gradients are compared")
    parser.add_argument("--max_tokens", type=int, default=4096, help="a micro-batch's token budget")
    parser.add_argument("--reference", choices=("eager", "sdpa"), default="eager",
                        help="the model's own attention to compare with")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32 compares tightly; bfloat16 runs the GPU kernels (looser tolerances)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = check_model(args.model, data=args.data, num_samples=args.samples, max_tokens=args.max_tokens,
                         data_config=load_data_config(args.data_config), tokenizer=args.tokenizer,
                         reference=args.reference, device=args.device, dtype=getattr(torch, args.dtype),
                         loss_samples=args.loss_samples)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(_text(report))
    return 0 if report.ok else 1


def _text(report) -> str:
    lines = [f"model_type: {report.model_type}"]
    router = "n/a (dense)" if report.aux_loss_included is None else report.aux_loss_included
    if report.refused is not None:
        lines.append(f"REFUSED: {report.refused}")
    else:
        lines += [f"samples: {report.samples} ({report.packing} micro-batches); skipped: {report.skipped or 'none'}",
                  f"max logit diff: {report.max_logit_diff}", f"loss rel diff: {report.loss_rel_diff}",
                  f"grad rel diff: {report.grad_rel_diff}",
                  f"router loss included: {router}",
                  f"image processor max diff: {report.image_processor_max_diff}",
                  f"video processor max diff: {report.video_processor_max_diff}",
                  "labels of the first sample: " + " | ".join(report.label_preview)]
        lines += [f"OFF: {problem}" for problem in report.problems]
        lines += [f"note: {note}" for note in report.notes]
    lines.append("ok" if report.ok else "NOT OK")
    return "\n".join(lines)
