#!/usr/bin/env python
"""The cost of odb's round at cluster scale: bytes on the wire, the decision's CPU time, a gloo model.

    python tools/bench/bench_round.py --trace ../shared/traces/sharegpt4o_like.txt \\
        --world_sizes 8 64 512 4096 16384 --json

Weak scaling: every rank holds the same work (``--samples_per_rank``). An 8-rank run of the real
batcher over the trace (``--max_tokens``, ``--window``, ``--gas``) records every round as the
ranks received it (the gathered proposals and the decision's arguments); a round at ``W`` ranks is
that round with each rank's proposal repeated ``W / 8`` times (rank ``r`` holds real rank
``r % 8``'s state) and the stream's undealt indices scaled by ``W / 8``. For each ``W``:

* ``row_int64``: one rank's round row as a training run sends it, the mean over ranks and rounds:
  the proposal, the cost fit's part (``cost_model`` 'fit': the micro-batches the rank trained since
  the last round, at most ``min(32, 256 // W)``), the telemetry report of the steps the round
  before planned, each array cut to what it uses
  (:meth:`odb.batching.wire.Layout.pack`); ``--wire fixed``: the whole vector, as odb sent it up to
  the commit that cut it (run this file from a checkout of that commit to time its decision).
* ``received_bytes``: what one rank receives in the round (every rank's row), the mean over rounds.
* ``decision_ms``: one rank's CPU time in the round's decision on the W-rank proposals (the median
  of ``--repeat`` runs of each recorded round, the mean over rounds).
* ``gather_ms``: a first-order model of the collective. ``rows``: Bruck's all_gather over gloo's
  point-to-point sends (:class:`odb.batching.comm.TorchCommunicator`), ``ceil(log2 W)`` exchanges
  of two messages (the rows' lengths, then the rows), ``2 ceil(log2 W) alpha + received / beta``.
  ``fixed``: gloo's own all_gather, a ring (``gloo/allgather.cc``: each rank's vector goes round in
  two halves, two transfers in flight), ``(W - 1) (alpha + vector / beta)``. ``--alpha_us`` (one
  message's latency over TCP) and ``--beta_gbs`` (one TCP stream's bandwidth) are in the output.
* ``round_ms`` and ``share_of_<s>s_step``: one round against one ``--step_s`` step;
  ``per_step_share_of_<s>s``: per optimizer step (a round plans ``1 / rounds_per_step`` steps,
  measured in the 8-rank run).
"""

from __future__ import annotations

import argparse
import json
import math
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

try:
    from odb.batching.fit import send_for  # noqa: E402
except ImportError:  # a checkout from before rows were cut: --wire fixed only
    send_for = None
from odb.batching.wire import Layout, proposal_layout  # noqa: E402
from odb.telemetry.reports import report_layout  # noqa: E402
from tools.traces import read_lengths  # noqa: E402

BASE_WORLD = 8


def round_layout(config: OdbConfig, world: int, steps: int, *, fixed: bool) -> Layout:
    """One rank's round vector in a training run: the proposal, the fit's part (``cost_model``
    'fit'), the telemetry report of ``steps`` steps (``fixed``: room for every step a round can
    plan, and for the fit's 32 observations, as odb laid them out before rows were cut)."""
    capacity = config.window + config.lookahead
    layout = proposal_layout(capacity, capacity, per_sample_costs=config.mode == "quota")
    if config.cost_model == "fit":
        layout = layout.then(fit_layout() if fixed else fit_layout(send_for(world)))
    return layout.then(report_layout(capacity // config.gas + 1 if fixed else steps))


def row_int64(config: OdbConfig, fields: dict, world: int, steps: int) -> float:
    """The mean row over the recorded ranks: the proposal's used arrays, the fit's part (the
    micro-batches a rank trained in the ``steps`` steps, at most what it sends), the report of
    ``steps`` steps (each cut to what it uses, plus the row's report length)."""
    layout = round_layout(config, world, steps, fixed=False)
    scalars = len(layout.scalars) + 1  # (+ the report's length)
    bins = fields["num_bins"].astype(np.int64)
    per_bin = sum(1 for name in layout.arrays if name.startswith("bin_"))
    per_sample = sum(1 for name in layout.arrays if name.startswith("sample_"))
    binned = fields["bin_samples"].sum(axis=1) if per_sample else 0
    fit_arrays = [size for name, size in layout.arrays.items() if name.startswith("fit_")]
    fit = len(fit_arrays) * min(steps * config.gas, max(fit_arrays, default=0))
    report = sum(size for name, size in layout.arrays.items() if name in report_layout(steps).arrays)
    return float(np.mean(scalars + per_bin * bins + per_sample * binned + fit + report))


def record_rounds(config: OdbConfig, lengths: list[tuple[int, int]]) -> tuple[list[tuple[dict, dict]], dict]:
    """Every round of an 8-rank run, once (every rank decides it from the same proposals):
    ``(fields, arguments)``; and the run's rounds and steps."""
    rounds: list[tuple[dict, dict]] = []
    decide, seen = align.decide, set()

    def recording(fields, **kwargs):
        if (kwargs["epoch"], kwargs["round_index"]) not in seen:
            seen.add((kwargs["epoch"], kwargs["round_index"]))
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


def gather_ms(world: int, received_bytes: float, vector_bytes: float, alpha_us: float, beta_gbs: float,
              *, fixed: bool) -> float:
    """The collective's time, first order (the module docstring): a ring of fixed vectors, or Bruck's rows."""
    alpha, beta = alpha_us * 1e-6, beta_gbs * 1e9
    if fixed:
        return 1e3 * (world - 1) * (alpha + vector_bytes / beta)
    return 1e3 * (2 * math.ceil(math.log2(world)) * alpha + received_bytes / beta) if world > 1 else 0.0


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
    parser.add_argument("--wire", choices=("rows", "fixed"), default="rows",
                        help="rows: each array cut to its use, Bruck's gather; fixed: the whole vector, gloo's ring")
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
    fixed = args.wire == "fixed"
    rounds_per_step = run["rounds"] / max(1, run["steps"])
    steps = [0] + [len(align.decide(f, **k).step_label_tokens) for f, k in rounds[:-1]]  # (reported a round later)
    rows = []
    for world in args.world_sizes:
        if fixed:
            row = float(round_layout(config, world, 0, fixed=True).size)
        else:
            row = float(np.mean([row_int64(config, f, world, n) for (f, _), n in zip(rounds, steps)]))
        received = 8 * row * world
        decide_ms = decision_ms(rounds, world, args.repeat)
        gather = gather_ms(world, received, 8 * row, args.alpha_us, args.beta_gbs, fixed=fixed)
        round_ms = decide_ms + gather
        rows.append({"world": world, "row_int64": round(row, 1), "received_bytes": round(received),
                     "decision_ms": round(decide_ms, 3), "gather_ms": round(gather, 3), "round_ms": round(round_ms, 3),
                     **{f"share_of_{s:g}s_step": round(round_ms / (1e3 * s), 5) for s in args.step_s},
                     **{f"per_step_share_of_{s:g}s": round(rounds_per_step * round_ms / (1e3 * s), 6)
                        for s in args.step_s}})
        print(f"W={world:>6}  row {row:9.1f} int64  received {received / 2**20:9.2f} MiB  "
              f"decision {decide_ms:8.3f} ms  gather {gather:9.3f} ms  round {round_ms:9.3f} ms", file=sys.stderr)
    report = {"trace": Path(args.trace).name, "samples_per_rank": args.samples_per_rank,
              "max_tokens": args.max_tokens, "window": args.window, "gas": args.gas,
              "wire": args.wire, "alpha_us": args.alpha_us, "beta_gbs": args.beta_gbs, "rounds_recorded": len(rounds),
              "rounds_per_step": round(rounds_per_step, 5), **run, "rows": rows}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
