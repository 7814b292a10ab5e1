#!/usr/bin/env python
"""The cost of odb's round at cluster scale: bytes on the wire, the decision's CPU time, a gloo model.

    python tools/bench/bench_round.py --trace ../shared/traces/sharegpt4o_like.txt \\
        --world_sizes 8 64 512 4096 16384 --json

Weak scaling: every rank holds the same work (``--samples_per_rank``). An 8-rank run of the real
batcher over the trace (``--max_tokens``, ``--window``, ``--gas``) records every round as one rank
received it (the gathered matrix and the decision's arguments); a round at ``W`` ranks is that
round's matrix with each row repeated ``W / 8`` times (row ``r`` is real rank ``r % 8``'s state) and
the stream's undealt indices scaled by ``W / 8``. For each ``W`` the tool reports:

* ``vector_int64`` / ``sent_bytes``: one rank's round vector as a training run lays it out (the
  proposal, the cost fit's part, the telemetry report; :func:`round_layout`), and
  ``received_bytes``: what one rank receives in the round's collectives (``W x`` vector for an
  all_gather).
* ``decision_ms``: one rank's CPU time in the round's decision on the W-row matrix (the median of
  ``--repeat`` runs of each recorded round, averaged over the rounds).
* ``gather_ms``: a first-order model of gloo's all_gather: a ring (``gloo/allgather.cc``: each
  rank's vector goes round in two halves, ``W - 1`` hops, two transfers in flight), so
  ``(W - 1) x (alpha + vector_bytes / beta)``; ``--alpha_us`` (one hop's latency over TCP) and
  ``--beta_gbs`` (one TCP stream's bandwidth) are stated in the output.
* ``round_ms`` and its share of a ``--step_s`` step (each, per optimizer step: ``rounds_per_step
  x round_ms``; rounds per step measured in the 8-rank run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odb.batching import align  # noqa: E402
from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.fit import fit_layout  # noqa: E402
from odb.batching.simulate import simulate  # noqa: E402
from odb.batching.wire import Layout, proposal_layout  # noqa: E402
from odb.telemetry.reports import report_layout  # noqa: E402
from tools.traces import read_lengths  # noqa: E402

BASE_WORLD = 8


def round_layout(config: OdbConfig) -> Layout:
    """One rank's round vector in a training run: the proposal, the fit's part (``cost_model``
    'fit'), the telemetry report (room for every step a round can plan), as ``launch/train.py``
    lays them out."""
    capacity = config.window + config.lookahead
    layout = proposal_layout(capacity, capacity, per_sample_costs=config.mode == "quota")
    if config.cost_model == "fit":
        layout = layout.then(fit_layout())
    return layout.then(report_layout(capacity // config.gas + 1))


def record_rounds(config: OdbConfig, lengths: list[tuple[int, int]]) -> tuple[list[tuple[dict, dict]], dict]:
    """Every round of an 8-rank run, once (every rank decides it from the same gathered matrix):
    ``(fields, arguments)``; and the run's rounds and steps."""
    rounds: list[tuple[dict, dict]] = []
    decide, last = align.decide, [None]

    def recording(fields, **kwargs):
        gathered = next(iter(fields.values())).base  # (decode's fields are views of the gathered matrix)
        if gathered is None or gathered is not last[0]:
            last[0] = gathered
            rounds.append(({name: np.array(value) for name, value in fields.items()}, dict(kwargs)))
        return decide(fields, **kwargs)

    align.decide = recording
    try:
        result = simulate(config, lengths, BASE_WORLD)
    finally:
        align.decide = decide
    return rounds, {"rounds": result.batchers[0].round_index, "steps": len(result.steps[0])}


def scaled(fields: dict, kwargs: dict, world: int) -> tuple[dict, dict]:
    """The round at ``world`` ranks: each row repeated, the undealt stream scaled alike."""
    reps = world // BASE_WORLD
    out = {name: np.tile(value, (reps,) + (1,) * (value.ndim - 1)) for name, value in fields.items()}
    kwargs = dict(kwargs)
    for key in ("stream_left", "stream_ready"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key] * reps
    return out, kwargs


def decision_ms(rounds: list[tuple[dict, dict]], world: int, repeat: int) -> float:
    """One rank's mean CPU time in :func:`odb.batching.decide.decide` per round at ``world`` ranks."""
    per_round = []
    for fields, kwargs in rounds:
        fields, kwargs = scaled(fields, kwargs, world)
        times = []
        for _ in range(repeat):
            start = time.process_time()
            align.decide(fields, **kwargs)
            times.append(time.process_time() - start)
        per_round.append(statistics.median(times))
    return 1e3 * statistics.fmean(per_round)


def gather_ms(world: int, vector_bytes: int, alpha_us: float, beta_gbs: float) -> float:
    """gloo's ring all_gather, first order: ``W - 1`` hops of one vector each."""
    return 1e3 * (world - 1) * (alpha_us * 1e-6 + vector_bytes / (beta_gbs * 1e9))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="one sample per line: tokens [vision_patches]")
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[8, 64, 512, 4096, 16384])
    parser.add_argument("--samples_per_rank", type=int, default=2000)
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--alpha_us", type=float, default=30.0, help="one hop's latency (gloo over TCP)")
    parser.add_argument("--beta_gbs", type=float, default=5.0, help="one TCP stream's bandwidth, GB/s")
    parser.add_argument("--step_s", type=float, nargs="+", default=[1.0, 5.0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    for world in args.world_sizes:
        if world % BASE_WORLD:
            raise SystemExit(f"error: --world_sizes must be multiples of {BASE_WORLD}, got {world}")
    trace = read_lengths(args.trace)
    count = args.samples_per_rank * BASE_WORLD
    lengths = [trace[i % len(trace)] for i in range(count)]
    config = OdbConfig(max_tokens=args.max_tokens, window=args.window, gas=args.gas)
    rounds, run = record_rounds(config, lengths)
    vector = round_layout(config).size
    rounds_per_step = run["rounds"] / max(1, run["steps"])
    rows = []
    for world in args.world_sizes:
        decide_ms = decision_ms(rounds, world, args.repeat)
        gather = gather_ms(world, 8 * vector, args.alpha_us, args.beta_gbs)
        round_ms = decide_ms + gather
        rows.append({"world": world, "vector_int64": vector, "sent_bytes": 8 * vector,
                     "received_bytes": 8 * vector * world, "decision_ms": round(decide_ms, 3),
                     "gather_ms": round(gather, 3), "round_ms": round(round_ms, 3),
                     **{f"share_of_{s:g}s_step": round(rounds_per_step * round_ms / (1e3 * s), 5)
                        for s in args.step_s}})
        print(f"W={world:>6}  vector {vector} int64  received {8 * vector * world / 2**20:9.2f} MiB  "
              f"decision {decide_ms:8.3f} ms  gather {gather:9.3f} ms", file=sys.stderr)
    report = {"trace": Path(args.trace).name, "samples_per_rank": args.samples_per_rank,
              "max_tokens": args.max_tokens, "window": args.window, "gas": args.gas,
              "alpha_us": args.alpha_us, "beta_gbs": args.beta_gbs, "rounds_recorded": len(rounds),
              "rounds_per_step": round(rounds_per_step, 5), **run, "rows": rows}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
