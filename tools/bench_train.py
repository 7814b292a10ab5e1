#!/usr/bin/env python
"""Training throughput on CPU: the same samples, odb (packed rows) against fixed batches (padded).

    python tools/bench_train.py --max_samples 600

Runs launch/train.py once per policy (one process, the tiny default model and bundled data) and
prints samples/s, real tokens/s and padding ratio side by side, from each run's summary.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(policy: dict, args: argparse.Namespace, tmp: Path) -> dict:
    config = json.loads((ROOT / "configs" / "odb.json").read_text())
    config.update(max_tokens=args.max_tokens, **policy)
    name = policy["policy"]
    (tmp / f"{name}.json").write_text(json.dumps(config))
    out = tmp / name
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--odb_config", str(tmp / f"{name}.json"),
           "--max_samples", str(args.max_samples), "--output_dir", str(out), "--no_final_checkpoint",
           "--deepspeed_config", str(ROOT / "configs" / "ds_zero0.json"), "--num_workers", "1"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=not args.verbose)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_samples", type=int, default=600)
    parser.add_argument("--max_tokens", type=int, default=2048, help="odb's token budget per micro-batch")
    parser.add_argument("--batch_size", type=int, default=8, help="samples per fixed (padded) batch")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    policies = [{"policy": "odb"}, {"policy": "fixed", "batch_size": args.batch_size, "sharding": "static"}]
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(p, args, Path(tmp)) for p in policies]
    print("| policy | samples | steps | micro-batches | samples/s | real tokens/s | padding ratio |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in zip(policies, results):
        label = "odb (packed, max_tokens %d)" % args.max_tokens if policy["policy"] == "odb" else \
            f"fixed (batch {args.batch_size}, padded)"
        print(f"| {label} | {r['samples_emitted']} | {r['steps']} | {r['micro_batches']} | "
              f"{r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['padding_ratio']:.3f} |")
    print(json.dumps({p["policy"]: r for p, r in zip(policies, results)}))


if __name__ == "__main__":
    main()
