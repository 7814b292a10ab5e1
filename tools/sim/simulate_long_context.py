#!/usr/bin/env python
"""Predict truncation against static sequence parallelism on a long-tail trace, at 8-64 GPUs.

    python tools/sim/simulate_long_context.py --nodes 1 2 4 8 --max-tokens 16384 --json

The trace (:func:`long_tail`, seeded; tools/bench/bench_long_context.py runs it on CPU): most samples
short, ``--long-share`` of them 4-16x ``--max-tokens`` (a GPU's budget). Systems: ``truncate``
(every GPU its own micro-batches; a longer sample cut to the budget and trained, though a real run
may lose it whole: a cut that leaves no label) and ``spS`` for each ``--sizes`` S (groups of S
GPUs train micro-batches of up to S x the budget together, each GPU 1/S of every row; longer
samples cut to that), and ``per-micro-batch sp<=S`` (over_cap 'sequence_parallel' with ``max_sp``
the largest S: every GPU packs its own micro-batches; a sample over the budget goes, at one
micro-batch position, to the smallest aligned group of GPUs that holds it, while the other GPUs
train their own). The batches are odb's own: the real ``OnlineBatcher`` plans over the W / S groups
(tools/sim/simulate_cluster.py's :func:`plan`), its cost model set as the fit would find it on this
model of time (``attn_coef = layers x hidden / compute params``: attention's FLOPs per ``L^2``
over the linear layers' per token); only time is modelled, as there (its module docstring:
FLOP/s, ZeRO's collectives over all W GPUs, the optimizer step), plus what sequence parallelism adds::

    micro-batch on a GPU of a group = compute(T, A) / S + all_to_all(T)      (per micro-batch: S = its group's)
    all_to_all(T) = layers x 2 (forward, backward) x (2 hidden + 2 kv_hidden) x 2 bytes x T / S x (S - 1) / S / B

``T``: the row's tokens, ``A``: its attention area (``sum L^2``); each GPU computes a 1/S of the
row's tokens for the linear layers and a 1/S of the heads for attention. Per layer Ulysses
exchanges q, k, v before attention and its output after (bf16), the same again in the backward;
``B``: NVLink inside a node (a group never spans nodes here: S <= GPUs per node). Position ids'
all-gather and latency are left out. What is measured on CPU is in tools/bench/bench_long_context.py;
this is a model of time, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from odb.batching.config import load_odb_config  # noqa: E402
from tools.sim.simulate_cluster import Cluster, Model, load_model, micro_seconds, plan, workload  # noqa: E402

__all__ = ["all_to_all_seconds", "long_tail", "simulate_system"]


def long_tail(samples: int, max_tokens: int, *, long_share: float, seed: int) -> list[int]:
    """The trace: ``long_share`` of the samples 4-16x ``max_tokens`` (uniform), the rest log-normal
    around a third of it, 16 tokens at least and ``max_tokens`` at most; seeded, shuffled."""
    rng = np.random.default_rng(seed)
    num_long = round(samples * long_share)
    short = np.clip(rng.lognormal(np.log(max_tokens / 3), 0.6, samples - num_long), 16, max_tokens)
    long = rng.uniform(4 * max_tokens, 16 * max_tokens, num_long)
    lengths = np.concatenate([short, long]).astype(int)
    rng.shuffle(lengths)
    return lengths.tolist()


def all_to_all_seconds(tokens: np.ndarray, model: Model, cluster: Cluster, size) -> np.ndarray:
    """Ulysses' exchanges for micro-batches of ``tokens`` (the whole rows') on one GPU of a group of
    ``size`` (a number, or one per micro-batch; the module docstring's formula); 0 where 1."""
    size = np.broadcast_to(np.asarray(size, dtype=np.float64), np.shape(tokens))
    width = 2 * model.hidden + 2 * model.kv_hidden
    sent = model.layers * 2 * width * 2.0 * tokens / size * (size - 1) / size
    return sent / (cluster.intra_gbs * 1e9)


def simulate_system(size: int, lengths: list[int], base, model: Model, cluster: Cluster, *,
                    per_micro_batch: bool = False) -> dict:
    """One system (``size`` 1: truncation) on ``lengths``: its plan over the W / size groups, timed.
    ``per_micro_batch``: every GPU plans its own micro-batches, and a sample over the budget goes
    to the smallest group of up to ``size`` GPUs that holds it (over_cap 'sequence_parallel')."""
    budget = size * base.max_tokens
    kept = [(min(n, budget), 0) for n in lengths]
    if per_micro_batch:
        config = dataclasses.replace(base, over_cap="sequence_parallel", max_sp=size)
        arrays = plan(config, kept, cluster.world)
        compute = micro_seconds(arrays, model, cluster)  # [positions, GPUs]: a slice's own figures
        exchange = all_to_all_seconds(arrays["tokens"] * arrays["degree"], model, cluster, arrays["degree"])
    else:
        arrays = plan(dataclasses.replace(base, max_tokens=budget), kept, cluster.world // size)
        compute = micro_seconds(arrays, model, cluster) / size  # [positions, groups]
        exchange = all_to_all_seconds(arrays["tokens"], model, cluster, size)
    per_gpu = compute + exchange
    slowest = per_gpu.max(axis=1)
    comm_micro, comm_step = cluster.comm_s(model)
    steps = len(arrays["gas"])
    seconds = float(slowest.sum()) + len(slowest) * comm_micro + steps * (comm_step + cluster.optimizer_s(model))
    cut = sum(max(0, n - budget) for n in lengths)
    return {"samples_per_s": round(arrays["samples"] / seconds, 3), "tokens_per_s": round(arrays["real"] / seconds, 1),
            "cut_share": round(cut / sum(lengths), 4), "samples_cut": sum(n > budget for n in lengths),
            "sync_efficiency": round(float(per_gpu.mean(axis=1).sum() / slowest.sum()), 4),
            "all_to_all_share": round(float(exchange.max(axis=1).sum()) / seconds, 4),
            "steps": steps, "seconds": round(seconds, 3)}


def markdown(rows: list[dict]) -> str:
    lines = ["| GPUs | system | samples/s | trained tokens/s | tokens cut | samples cut | sync efficiency "
             "| all-to-all share |", "|" + "---|" * 8]
    for row in rows:
        for name, r in row["systems"].items():
            lines.append(f"| {row['gpus']} | {name} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                         f"{r['cut_share']:.1%} | {r['samples_cut']} | {r['sync_efficiency']:.3f} | "
                         f"{r['all_to_all_share']:.1%} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="sequence-parallel sizes to compare")
    p.add_argument("--max-tokens", type=int, default=16384, help="a GPU's token budget per micro-batch")
    p.add_argument("--long-share", type=float, default=0.05, help="the share of samples 4-16x the budget")
    p.add_argument("--trace-samples", type=int, default=5000, help="samples in the trace")
    p.add_argument("--samples-per-gpu", type=int, default=200, help="the per-GPU load (weak scaling)")
    p.add_argument("--tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of one GPU (H100 SXM)")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--intra-gbs", type=float, default=450.0, help="GB/s per GPU inside a node (NVLink)")
    p.add_argument("--inter-gbs", type=float, default=50.0, help="GB/s per GPU between nodes")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument("--model", default="7b", help="'7b' (Llama-2-7B) or a Llama-style config.json")
    p.add_argument("--odb-config", default=str(ROOT / "configs" / "odb.json"))
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if any(s < 2 or args.gpus_per_node % s for s in args.sizes):
        p.error(f"--sizes must be >= 2 and divide --gpus-per-node {args.gpus_per_node}")
    if min(args.nodes) < 1 or not 0 <= args.long_share <= 1:
        p.error("--nodes must be >= 1 and --long-share in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = load_model(args.model)
    rate = args.tflops * 1e12 * args.mfu
    # the all-to-all per token of a slice, in tokens' compute time (as the fit would find it; at d = 2)
    linear = float(model.flops(np.array(1.0), np.array(0.0), np.array(0.0))[0]) / rate
    a2a = model.layers * 2 * (2 * model.hidden + 2 * model.kv_hidden) * 2.0 * 0.5 / (args.intra_gbs * 1e9)
    base = load_odb_config(args.odb_config, max_tokens=args.max_tokens, window=args.window, seed=args.seed,
                           cost_model="manual", attn_coef=model.layers * model.hidden / model.compute_params,
                           a2a_coef=round(a2a / linear, 4))
    trace = long_tail(args.trace_samples, args.max_tokens, long_share=args.long_share, seed=args.seed)
    rows = []
    for nodes in args.nodes:
        cluster = Cluster(nodes=nodes, gpus_per_node=args.gpus_per_node, flops_per_s=rate, attn_flops_per_s=rate,
                          intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs, zero=args.zero)
        lengths = [n for n, _ in workload([(n, 0) for n in trace], args.samples_per_gpu * cluster.world, args.seed)]
        systems = {"truncate": simulate_system(1, lengths, base, model, cluster)}
        for size in args.sizes:
            systems[f"sp{size}"] = simulate_system(size, lengths, base, model, cluster)
        largest = max(args.sizes)
        systems[f"per-micro-batch sp<={largest}"] = simulate_system(largest, lengths, base, model, cluster,
                                                                    per_micro_batch=True)
        rows.append({"nodes": nodes, "gpus": cluster.world, "samples": len(lengths), "systems": systems})
        print(f"simulated {cluster.world} GPUs", file=sys.stderr, flush=True)
    print(markdown(rows))
    report = {"settings": {"model": dataclasses.asdict(model), "max_tokens": args.max_tokens,
                           "long_share": args.long_share, "zero": args.zero, "tflops": args.tflops, "mfu": args.mfu,
                           "intra_gbs": args.intra_gbs, "samples_per_gpu": args.samples_per_gpu},
              "results": rows}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
