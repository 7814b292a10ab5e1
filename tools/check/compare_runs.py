#!/usr/bin/env python
"""Whether two runs trained the same: their per-step metrics rows (losses, learning rates, samples,
tokens, the plan's figures; not times) and their audit files (``--audit_ids``: every micro-batch's
sample ids), to check that a change leaves a run as it was::

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/ds_zero2.json --cost_model manual \\
        --audit_ids --output_dir runs/after
    git worktree add /tmp/before OLD && (cd /tmp/before && deepspeed ... --output_dir /tmp/runs/before)
    python tools/check/compare_runs.py /tmp/runs/before runs/after

``--cost_model manual``: the default cost model is fitted to measured step times, so two runs of the
same code may plan differently once the fit moves (seen here: the bundled run's steps agree up to
the fit's first change, step 52 of 67). Exits 1 on any difference, naming the first ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMED = ("time", "step_s", "samples_per_s", "tokens_per_s", "materialized_tokens_per_s", "data_wait_s",
         "odb_plan_s", "odb_collective_s", "forward_s", "sync_efficiency", "mfu", "eval_s", "seconds")
"""Keys of a metrics row that measure time (they differ between any two runs)."""


def rows(folder: Path) -> list[dict]:
    """The run's metrics rows, the timed keys left out."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMED} for line in lines if line.strip()]


def audit(folder: Path) -> dict[str, list[str]]:
    return {path.name: path.read_text().splitlines() for path in sorted(folder.glob("emitted_ids.rank*.jsonl"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    before, after = rows(args.before), rows(args.after)
    diffs = [f"row {i}: " + ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(a.keys() | b.keys())
                                     if a.get(k) != b.get(k))
             for i, (a, b) in enumerate(zip(before, after)) if a != b]
    if len(before) != len(after):
        diffs.insert(0, f"{len(before)} metrics rows against {len(after)}")
    audits = audit(args.before), audit(args.after)
    if audits[0].keys() != audits[1].keys():
        diffs.append(f"audit files {sorted(audits[0])} against {sorted(audits[1])}")
    for name in sorted(audits[0].keys() & audits[1].keys()):
        if audits[0][name] != audits[1][name]:
            diffs.append(f"{name} differs")
    lines = sum(len(v) for v in audits[1].values())
    if diffs:
        print(f"DIFFERENT ({len(diffs)}):\n  " + "\n  ".join(diffs[:5]))
        return 1
    losses = [r["loss"] for r in after if "loss" in r]
    if not losses:
        print(f"identical, but no step rows with a loss in {args.after}: did the runs train?")
        return 1
    print(f"identical: {len(after)} metrics rows ({len(losses)} steps, loss {losses[0]} -> {losses[-1]}), "
          f"{lines} audit lines in {len(audits[1])} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
