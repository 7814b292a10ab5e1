#!/usr/bin/env python
"""Long context: truncation against sequence parallelism on a long-tail trace, side by side.

    python tools/bench/bench_long_context.py --samples 400 --max_tokens 256 --world_size 4 --json

The trace (seeded, made here): most samples short (log-normal around a third of ``--max_tokens``,
at most the budget), ``--long_share`` of them (5%) 4-16x the budget (uniform). Systems
(``--systems``):

``truncate``  ``--sequence_parallel_size 1``: every rank packs its own micro-batches under
              ``max_tokens``; a longer sample is cut to it (``over_cap`` truncate, at the token:
              ``truncation: tokens``; cut at whole turns, the one-answer records here would lose
              their only answer and be skipped)
``sp2``, ``sp4``  ``--sequence_parallel_size 2`` / ``4``: groups of 2 / 4 ranks train micro-batches
              of up to 2 / 4 x ``max_tokens`` together (each rank 1/S of every row); longer
              samples are cut to that
``per_micro_batch``  ``--over_cap sequence_parallel --max_sp W``: every rank packs its own
              micro-batches under ``max_tokens``; a longer sample trains at one position on the
              smallest aligned group of 2, 4, ... ranks that holds it (up to W x ``max_tokens``;
              longer ones cut to that), while the other ranks train their own micro-batches

Every system trains the same initial weights (configs/tiny_model.json, seeded), the same chat
records (tools/make/make_trace_data.py, one per length), one epoch, ZeRO-2, AdamW, odb's online
batching, ``--world_size`` ranks under the deepspeed launcher (on CPU the cores split evenly over
the ranks). ``max_tokens`` is a rank's budget in every system. Per system: samples/s and trained
tokens/s over the run's wall time, padding, the measured sync efficiency (the ranks' mean forward
time over the slowest's, weighted by step time), the share of the trace's tokens that did not
train (cut off, or in samples lost: a record cut to its prompt has no label left and is skipped),
the samples cut and those lost, from the run's own summary.json and metrics.jsonl.

What holds only on CPU: the all-to-all runs on gloo between processes of one machine, and a rank
computes on one core; on GPUs the all-to-all runs over NVLink (NCCL) and attention is a far
smaller share of a step. Prints a markdown table and, with ``--json``, one JSON object as the last
line of stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from odb.batching.cost import sequence_parallel_degrees  # noqa: E402
from tools.bench.bench_train import parse_run_arguments, prepare, run_project  # noqa: E402
from tools.sim.simulate_long_context import long_tail  # noqa: E402

SYSTEMS = {"truncate": 1, "sp2": 2, "sp4": 4, "per_micro_batch": 1}


def row(out: Path, trace_tokens: int) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step_s" in r]
    step_s = sum(r["step_s"] for r in steps)
    return {"samples_per_s": summary["samples_per_s"], "tokens_per_s": summary["tokens_per_s"],
            "padding_ratio": summary["padding_ratio"], "steps": summary["steps"],
            "sync_efficiency": round(sum(r["sync_efficiency"] * r["step_s"] for r in steps) / max(1e-9, step_s), 4),
            "untrained_share": round(1 - summary["real_tokens"] / trace_tokens, 4),
            "samples_cut": summary["truncated_samples"], "samples": summary["samples_emitted"],
            "samples_lost": sum(summary["skipped"].values()) + summary["dropped"],
            "wall_s": summary["wall_s"], "final_loss": summary["loss_last"]}


def markdown(result: dict) -> str:
    lines = ["| system | ranks x S | micro-batch budget | samples/s | trained tokens/s | padding | sync efficiency "
             "| tokens not trained | samples cut | samples lost | steps |", "|" + "---|" * 11]
    for name, r in result["systems"].items():
        size, world, budget = SYSTEMS[name], result["world_size"], result["max_tokens"]
        shape, holds = f"{world // size} x {size}", size * budget
        if name == "per_micro_batch":  # (a long sample: on a group of 2, 4, ... ranks)
            degrees = sequence_parallel_degrees(world, world)
            shape, holds = f"{world} x 1, long: {degrees[0]}-{degrees[-1]}", f"{budget} (long: {degrees[-1] * budget})"
        lines.append(f"| {name} | {shape} | {holds} | "
                     f"{r['samples_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['padding_ratio']:.3f} | "
                     f"{r['sync_efficiency']:.3f} | {r['untrained_share']:.1%} | {r['samples_cut']}/{r['samples']} | "
                     f"{r['samples_lost']} | {r['steps']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--max_tokens", type=int, default=256, help="a rank's token budget per micro-batch")
    parser.add_argument("--long_share", type=float, default=0.05, help="the share of samples 4-16x the budget")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--world_size", type=int, default=4, choices=(4, 8))
    parser.add_argument("--window", type=int, default=64)
    args = parse_run_arguments(parser, argv, SYSTEMS)
    if not 0 <= args.long_share <= 1 or args.samples < 1 or args.max_tokens < 16:
        parser.error("need 0 <= --long_share <= 1, --samples >= 1 and --max_tokens >= 16")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_long_context_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        lengths = long_tail(args.samples, args.max_tokens, long_share=args.long_share, seed=args.seed)
        trace = work / "trace.txt"
        trace.write_text("".join(f"{n}\n" for n in lengths))
        shared = prepare(argparse.Namespace(trace=trace, samples=args.samples, length_scale=1, seed=args.seed,
                                            max_tokens=17 * args.max_tokens), work)
        trace_tokens = sum(shared["lengths"].values())
        data_config = work / "data.json"
        data_config.write_text(json.dumps({"truncation": "tokens"}))
        result = {"samples": shared["dataset_size"], "world_size": args.world_size, "max_tokens": args.max_tokens,
                  "long_share": args.long_share, "trace_tokens": trace_tokens, "systems": {}}
        for name in args.systems:
            print(f"bench_long_context: {name} ...", file=sys.stderr, flush=True)
            extra = ["--sequence_parallel_size", str(SYSTEMS[name]), "--data_config", str(data_config)]
            if name == "per_micro_batch":
                extra += ["--over_cap", "sequence_parallel", "--max_sp", str(args.world_size)]
            out = run_project(name, args, shared, work, extra=extra)
            result["systems"][name] = row(out, trace_tokens)
    print(markdown(result))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
