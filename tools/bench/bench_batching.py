#!/usr/bin/env python
"""Benchmark the batching policies with the real packer and alignment over simulated ranks.

    python tools/bench/bench_batching.py --lengths ../shared/traces/ultrachat_like.txt \\
        --max-tokens 8192 --window 1024 --world-size 8 --gas 1 --policy odb --json

The last line of stdout is one JSON object (with ``--json``); see ``metrics()`` for the keys.
``--lengths`` deals samples the way the real sampler does (odb: one shared seeded stream dealt
to the least-loaded rank; fixed/gmt/bmt: strided static shards like DistributedSampler);
``--rank-lengths`` gives every rank an explicit shard.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.simulate import SimulationResult, simulate  # noqa: E402
from tools.traces import read_lengths  # noqa: E402


def read_rank_lengths(path: str) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """``{"ranks": [[tokens or [tokens, patches], ...], ...]}`` -> samples and per-rank shards."""
    ranks = json.loads(Path(path).read_text())["ranks"]
    lengths, shards = [], []
    for shard in ranks:
        shards.append(list(range(len(lengths), len(lengths) + len(shard))))
        lengths += [(int(x), 0) if isinstance(x, int) else (int(x[0]), int(x[1])) for x in shard]
    return lengths, shards


def metrics(result: SimulationResult, lengths: list[tuple[int, int]], config: OdbConfig,
            world_size: int) -> dict:
    micro = [m for steps in result.steps for step in steps for m in step.micro_batches]
    trained = [u for m in micro for u in m.uids]
    first = result.steps[0]
    per_rank_shape = [[len(s.micro_batches) for s in steps] for steps in result.steps]
    mean_sum = max_sum = 0.0
    for step in first:
        for costs in step.rank_costs:
            mean_sum += sum(costs) / len(costs)
            max_sum += max(costs)
    counts = [b.counts for b in result.batchers]
    dropped = sum(c["dropped"] for c in counts)
    real = sum(m.tokens for m in micro)
    materialized = sum(m.materialized for m in micro)
    capped = sum(min(t, config.max_tokens) for t, _ in lengths) if config.over_cap == "truncate" else \
        sum(t for t, _ in lengths if t <= config.max_tokens)
    batcher = result.batchers[0]
    return {
        "policy": config.policy, "world_size": world_size, "samples": len(lengths),
        "emitted": len(set(trained)), "duplicated": len(trained) - len(set(trained)),
        "dropped": dropped, "truncated": sum(c["truncated"] for c in counts),
        "steps": len(first), "micro_batches": sum(not m.is_dummy for m in micro),
        "dummy_micro_batches": sum(m.is_dummy for m in micro),
        "real_tokens": real, "materialized_tokens": materialized,
        "padding_ratio": round(1.0 - real / materialized, 6) if materialized else 0.0,
        "lower_bound_micro_batches": math.ceil(capped / config.max_tokens),
        "aligned": all(shape == per_rank_shape[0] for shape in per_rank_shape),
        "rounds": batcher.round_index, "collectives": batcher.aligner.comm.num_collectives,
        "sync_efficiency": round(mean_sum / max_sum, 6) if max_sum else 1.0,
        "us_per_sample": round(sum(b.plan_s for b in result.batchers) / max(1, len(lengths)) * 1e6, 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", help="one sample per line: tokens [vision_patches]")
    source.add_argument("--rank-lengths", help='JSON {"ranks": [[...], ...]}, one shard per rank')
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--policy", choices=("odb", "fixed", "gmt", "bmt"), default="odb")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch (fixed)")
    parser.add_argument("--mode", choices=("join", "quota"), default="join")
    parser.add_argument("--quota", type=int, default=None)
    parser.add_argument("--over-cap", choices=("truncate", "drop", "error"), default="truncate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3,
                        help="plan this many times (the same plan) and report the fastest planning time")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> tuple[dict, SimulationResult]:
    """Parses ``argv``, plans, and returns the report and the simulation (for other tools)."""
    args = parse_args(argv)
    shards = None
    if args.lengths:
        lengths = read_lengths(args.lengths)
        world_size = args.world_size
    else:
        lengths, shards = read_rank_lengths(args.rank_lengths)
        world_size = len(shards)
    static = shards is not None or args.policy != "odb"
    try:
        config = OdbConfig(max_tokens=args.max_tokens, window=args.window, gas=args.gas, mode=args.mode,
                           quota=args.quota, over_cap=args.over_cap, policy=args.policy,
                           batch_size=args.batch_size, seed=args.seed,
                           sharding="static" if static else "dynamic")
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    result = min((simulate(config, lengths, world_size, shards=shards) for _ in range(max(1, args.repeat))),
                 key=lambda r: sum(b.plan_s for b in r.batchers))
    return metrics(result, lengths, config, world_size), result


def main(argv: list[str] | None = None) -> None:
    report, _ = run(argv)
    if "--json" in (sys.argv[1:] if argv is None else argv):
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>26}: {value}")


if __name__ == "__main__":
    main()
