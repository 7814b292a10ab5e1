#!/usr/bin/env python
"""Scores saved weights with odb's own exact evaluator: the validation loss of each snapshot a
training run outside this project saved (tools/bench/paper_pkg_train.py's ``--snapshot_steps``), and of
the initial model, as launch/train.py's ``--eval_data`` scores its own runs.

One rank under the deepspeed launcher (tools/bench/bench_quality.py runs it)::

    python -c "from deepspeed.launcher.runner import main; main()" --num_gpus 1 tools/bench/eval_snapshots.py \\
        --model MODEL_DIR --data TRAIN.jsonl --eval_data VAL.jsonl --max_tokens 2048 \\
        --snapshots RUN/snapshots --out RUN/snapshot_evals.json

It builds launch/train.py's trainer on the initial model (``--max_tokens`` and the bundled odb
settings), then for the initial weights and each snapshot in ``snapshots.json`` loads them into the
trainer's model and runs its :class:`~odb.training.run.evaluate.Evaluator`: the same evaluator, the
same validation samples, as the project's own runs. Writes ``[{"step", "trained_s",
"samples_done", "eval_loss", "eval_label_tokens"}, ...]`` (step 0: the initial weights).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the initial model folder")
    parser.add_argument("--data", type=Path, required=True, help="the training records (for the trainer's build)")
    parser.add_argument("--eval_data", type=Path, required=True)
    parser.add_argument("--max_tokens", type=int, required=True)
    parser.add_argument("--snapshots", type=Path, required=True, help="a folder with snapshots.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's
    args = parser.parse_args()

    from odb.training.launch.flags import FileDefaults, parse_config
    from odb.training.run.loop import Trainer
    from odb.training.run.startup import check_startup

    with tempfile.TemporaryDirectory(prefix="eval_snapshots_") as tmp:
        config = parse_config(["--model", str(args.model), "--data", str(args.data), "--eval_data", str(args.eval_data),
                               "--max_tokens", str(args.max_tokens), "--output_dir", tmp, "--no_final_checkpoint",
                               "--num_workers", "0", "--max_samples", "8"], defaults=FileDefaults.bundled())
        check_startup(config)
        trainer = Trainer.init(config)
        try:
            trainer.build()
            parts = trainer.parts
            module = parts.engine.backend.module
            rows = [{"step": 0, "trained_s": 0.0, "samples_done": 0, **score(parts.evaluator)}]
            for entry in json.loads((args.snapshots / "snapshots.json").read_text()):
                weights = torch.load(args.snapshots / entry["file"], map_location="cpu")
                missing, unexpected = module.load_state_dict(weights, strict=False)
                if unexpected or [k for k in missing if "lm_head" not in k]:  # (a tied head is not saved twice)
                    raise RuntimeError(f"{entry['file']}: keys missing {missing}, unexpected {unexpected}")
                rows.append({"step": entry["step"], "trained_s": entry["trained_s"],
                             "samples_done": entry["samples_done"], **score(parts.evaluator)})
                print(f"eval_snapshots: step {entry['step']}: {rows[-1]['eval_loss']}", flush=True)
            args.out.write_text(json.dumps(rows, indent=1))
        finally:
            trainer.shutdown()


def score(evaluator) -> dict:
    result = evaluator.run()
    return {"eval_loss": result.loss, "eval_label_tokens": result.label_tokens}


if __name__ == "__main__":
    main()
