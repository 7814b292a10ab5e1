#!/usr/bin/env python
"""The default training job under each backend, side by side: DeepSpeed ZeRO-2 (the deepspeed
launcher) and FSDP2 (torchrun), on the same ranks, data and settings, alternating, ``--runs`` times.

    python tools/bench/bench_backends.py --nproc 2 --runs 2 [-- extra launch/train.py flags]

Prints one row per run (samples/s, tokens/s, steps, final loss, peak memory per rank, from each
run's ``summary.json``) and the median per backend; ``--json`` adds one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.bench_train import free_port  # noqa: E402

TRAIN = ROOT / "launch" / "train.py"


def launch(backend: str, nproc: int, out: Path, extra: list[str]) -> dict:
    """One run of ``launch/train.py`` under ``backend``'s launcher; its summary."""
    bin_dir = Path(sys.executable).parent
    if backend == "deepspeed":
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), str(TRAIN),
               "--deepspeed_config", str(ROOT / "configs" / "ds_zero2.json")]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), str(TRAIN),
               "--backend", "fsdp2", "--fsdp_config", str(ROOT / "configs" / "fsdp2.json")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # both launchers alike
    proc = subprocess.run([*cmd, "--output_dir", str(out), "--no_final_checkpoint", *extra], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--runs", type=int, default=2, help="runs per backend, alternating")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line at the end")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for launch/train.py")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    results: dict[str, list[dict]] = {"deepspeed": [], "fsdp2": []}
    print(f"{'backend':10} {'run':>3} {'samples/s':>10} {'tokens/s':>10} {'steps':>6} {'loss_last':>10} "
          f"{'peak MB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for backend in results:
                s = launch(backend, args.nproc, Path(tmp) / f"{backend}{run}", extra)
                row = {"samples_per_s": s["samples_per_s"], "tokens_per_s": s["tokens_per_s"], "steps": s["steps"],
                       "loss_last": s["loss_last"], "peak_memory_mb": s["this_process"]["peak_memory_mb"]}
                results[backend].append(row)
                print(f"{backend:10} {run:>3} {row['samples_per_s']:>10.2f} {row['tokens_per_s']:>10.0f} "
                      f"{row['steps']:>6} {row['loss_last']:>10.4f} {row['peak_memory_mb']:>8.0f}", flush=True)
    medians = {b: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for b, rows in results.items()}
    for backend, m in medians.items():
        print(f"{backend:10} med {m['samples_per_s']:>10.2f} {m['tokens_per_s']:>10.0f} {m['steps']:>6.0f} "
              f"{m['loss_last']:>10.4f} {m['peak_memory_mb']:>8.0f}")
    if args.json:
        print(json.dumps({"nproc": args.nproc, "runs": results, "median": medians}))


if __name__ == "__main__":
    main()
