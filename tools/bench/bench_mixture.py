"""A weighted data mixture over simulated ranks (odb/batching/mixture.py): how exact the trained
shares are, and what drawing the stream online costs in rounds, fill and dummy micro-batches,
against one shuffled pass over the same records without weights.

Two sources whose label tokens per record differ about 30x (20-60 tokens and 600-1800, as a chat
turn and a code file), weights 0.3 / 0.7 by label tokens, every record of both at least once
(``mix_epoch: all``: the short source is up-sampled), ``max_tokens`` 2048, window 256.

    python tools/bench/bench_mixture.py                      # the table
    python tools/bench/bench_mixture.py --ranks 2,8 --json   # one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.mixture import Mixture  # noqa: E402
from odb.batching.simulate import simulate  # noqa: E402

MAX_TOKENS = 2048


def sources(sizes: list[int], seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    ranges = [(20, 60), (600, 1800)]
    return [(int(rng.integers(*ranges[s])), 0) for s, size in enumerate(sizes) for _ in range(size)]


def measure(lengths, sizes, weights, world: int, mixed: bool, seed: int) -> dict:
    config = OdbConfig(max_tokens=MAX_TOKENS, window=256, cost_model="manual", seed=seed)
    result = simulate(config, lengths, world, mixture=(lambda: Mixture(sizes, weights, seed=seed)) if mixed else None)
    steps = result.steps[0]
    micro = [m for rank in result.steps for s in rank for m in s.micro_batches]
    tokens = sum(t for s in steps for c in s.rank_tokens for t in c)
    units = [0, 0]
    for m in micro:
        for uid in m.uids:
            units[int(uid % len(lengths) >= sizes[0])] += lengths[uid % len(lengths)][0] - 1
    total = sum(units)
    share = units[1] / total
    return {"samples": sum(len(m.uids) for m in micro), "rounds": result.batchers[0].round_index, "steps": len(steps),
            "fill": round(tokens / (len(micro) * MAX_TOKENS), 4), "dummy_micro_batches": sum(m.is_dummy for m in micro),
            "share_long": round(share, 4), "share_error_tokens": round(abs(units[1] - weights[1] * total)),
            "wall_s": round(result.wall_s, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,8", help="comma-separated world sizes")
    p.add_argument("--sizes", default="2000,400", help="records of the short and the long source")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sizes, weights = [int(x) for x in args.sizes.split(",")], [0.3, 0.7]
    lengths = sources(sizes, args.seed)
    out = {}
    for world in (int(x) for x in args.ranks.split(",")):
        for mixed in (True, False):
            out[f"{world} ranks, {'mixture 0.3/0.7' if mixed else 'one pass, no weights'}"] = \
                measure(lengths, sizes, weights, world, mixed, args.seed)
    if args.json:
        print(json.dumps(out))
        return
    keys = list(next(iter(out.values())))
    print(f"{'':36}" + "".join(f"{k:>20}" for k in keys))
    for name, row in out.items():
        print(f"{name:36}" + "".join(f"{row[k]!s:>20}" for k in keys))


if __name__ == "__main__":
    main()
