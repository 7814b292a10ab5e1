#!/usr/bin/env python
"""The batching table of docs/benchmarks.md: every policy on every trace, through bench_batching.py.

    python tools/bench/bench_report.py ../shared/traces/*.txt

Prints a markdown table (max_tokens 8192, window 1024, 8 ranks, GAS 1 unless given).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import bench_batching  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--policies", default="odb,fixed,gmt,bmt")
    parser.add_argument("--max-tokens", default="8192")
    parser.add_argument("--window", default="1024")
    parser.add_argument("--world-size", default="8")
    parser.add_argument("--gas", default="1")
    args = parser.parse_args()
    print("| trace | policy | micro-batches / lower bound | largest micro-batch (tokens incl. padding) | "
          "padding | sync efficiency | dummies | exact once | aligned | rounds | collectives/rank | us/sample |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for trace in args.traces:
        for policy in args.policies.split(","):
            r, result = bench_batching.run(["--lengths", trace, "--policy", policy, "--max-tokens",
                                            args.max_tokens, "--window", args.window, "--world-size",
                                            args.world_size, "--gas", args.gas])
            largest = max(m.materialized for steps in result.steps for s in steps for m in s.micro_batches)
            ratio = r["micro_batches"] / r["lower_bound_micro_batches"]
            exact = r["emitted"] + r["dropped"] == r["samples"] and r["duplicated"] == 0
            print(f"| {Path(trace).stem} | {policy} | {r['micro_batches']} / {r['lower_bound_micro_batches']} "
                  f"= {ratio:.3f}x | {largest} | {r['padding_ratio']:.3f} | {r['sync_efficiency']:.3f} | "
                  f"{r['dummy_micro_batches']} | {exact} | {r['aligned']} | {r['rounds']} | "
                  f"{r['collectives']} | {r['us_per_sample']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
