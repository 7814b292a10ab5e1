#!/usr/bin/env python
"""A digest of the plans odb's batcher makes on length traces: to check that a change leaves the
packing and the dealing as they were (``--root``: the checkout whose ``odb`` plans, e.g. a
``git worktree`` of an older commit; the default is this one).

    python tools/check/plan_digest.py ../shared/traces/*_like.txt > after.json
    git worktree add /tmp/before OLD
    python tools/check/plan_digest.py --root /tmp/before ../shared/traces/*_like.txt > before.json
    diff before.json after.json

Each trace is planned at each ``--world_sizes`` and policy (odb: window 1024; fixed: batches of 8,
window 256), ``max_tokens`` 4096, GAS 2, no step times (a fitted cost model keeps the configured
coefficients); the digest is the first 16 hex digits of the SHA-256 of every rank's micro-batches'
sample ids, in order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="length traces: one 'tokens [vision_patches]' per line")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]),
                        help="the checkout whose odb plans (default: this one)")
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools.traces import read_lengths  # (this checkout's reader, whatever --root is)

    sys.path.insert(0, args.root)
    import odb
    from odb.batching.config import OdbConfig
    from odb.batching.simulate import simulate

    assert Path(odb.__file__).resolve().is_relative_to(Path(args.root).resolve()), odb.__file__
    digests = {}
    for trace in args.traces:
        lengths = read_lengths(trace)
        for world in args.world_sizes:
            for policy, window in (("odb", 1024), ("fixed", 256)):
                config = OdbConfig(max_tokens=4096, window=window, gas=2, policy=policy)
                plans = [[[list(m.uids) for m in step.micro_batches] for step in rank]
                         for rank in simulate(config, lengths, world).steps]
                digest = hashlib.sha256(json.dumps(plans).encode()).hexdigest()[:16]
                digests[f"{Path(trace).name}/{world}/{policy}"] = digest
    print(json.dumps(digests, indent=1))


if __name__ == "__main__":
    main()
