#!/usr/bin/env python
"""Preference pairs: odb's packed pairs against padded pairs, over simulated ranks.

    python tools/bench/bench_preference.py                           # 16,000 pairs, 2 and 8 ranks, the tables
    python tools/bench/bench_preference.py --world_sizes 8 --json    # one JSON object as the last line

The trace (seeded, made here; no file read): each pair's prompt, chosen and rejected answer
lengths drawn independently, log-normal, ``--prompt_median`` 150 tokens (sigma 1.0, clipped to
8..2048) and ``--answer_median`` 250 (sigma 0.9, clipped to 4..4096), shaped after public
preference sets (UltraFeedback-like prompts and answers with tails to several thousand tokens).
A pair is two sequences, prompt + chosen and prompt + rejected (the prompt is not shared).

Systems, for the same pairs and the same ``--max_tokens`` a micro-batch:

``odb``      a pair is one packing unit of chosen + rejected tokens, packed online by odb's real
             batcher and alignment (``OdbConfig`` defaults: window, lookahead, join mode, dynamic
             sharding); each sequence is its own varlen segment.
``padded``   TRL-style: a micro-batch of B pairs is 2B rows padded to its longest sequence, B fixed,
             the largest with ``2 B x longest sequence of the trace <= max_tokens`` (the batch that
             never exceeds the budget); static shards (a seeded shuffle dealt round robin, as
             DistributedSampler), batches in shard order.
``grouped``  padded pairs with length grouping: each rank's shard in buckets of ``--bucket_size``
             pairs, each bucket sorted by its pairs' longest sequence (longest first) and cut
             greedily into micro-batches of as many pairs as fit ``2 n x longest <= max_tokens``
             (it needs the bucket's lengths before it batches it).

Per system and world size: pairs per micro-batch, the padding ratio (materialized tokens that are
padding), materialized tokens per pair, micro-batches per epoch (summed over ranks) and the
micro-batch positions (the most any rank trains: one step each at GAS 1), and the compute per epoch
by odb's FLOPs model (:func:`odb.telemetry.flops.step_flops`, Llama-2-7B's matmul parameters,
layers and width): ``6 N T`` over the materialized tokens plus ``6 layers hidden sum(L^2)``, a
packed sequence attending to itself, a padded row over its whole padded length. ``compute`` sums
every rank's; ``critical`` sums, over positions, the slowest rank's (ZeRO waits for it at every
micro-batch), the time the epoch takes if FLOPs were time. Ratios are over odb's. Not modelled: a
GPU's lower efficiency on small micro-batches, and per-micro-batch overheads (both favour odb's
fewer, fuller micro-batches).

``--recount RUN ...``: the padding of real runs of ``launch/train.py`` (made with ``--audit_ids``),
counted from their ``emitted_ids.rank*.jsonl`` and their data's pairs (tokenized again with the
run's tokenizer, default processing) as the model takes them: packed, every sequence its own
segment; padded (policy ``fixed``), 2B rows as long as the longest sequence (``collate_padded``).
``summary.json``'s ``padding_ratio`` (``summary_padding_ratio``) counts the same rows, so the two
agree; a run made before odb counted a pair as two rows says less there (it counted a padded pair
as one row of its two sequences' tokens, B x the longest pair); both are printed.

    python tools/bench/bench_preference.py --recount runs/pref_odb runs/pref_padded
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.simulate import simulate  # noqa: E402
from odb.telemetry.flops import step_flops  # noqa: E402
from tools.sim.simulate_cluster import LLAMA2_7B  # noqa: E402

__all__ = ["MicroBatch", "Pair", "grouped_batches", "metrics", "odb_batches", "padded_batch_size",
           "padded_batches", "preference_trace", "run"]

SYSTEMS = ("odb", "padded", "grouped")


@dataclass(frozen=True)
class Pair:
    """One preference pair's lengths in tokens: the prompt and each answer."""

    prompt: int
    chosen: int
    rejected: int

    @property
    def sequences(self) -> tuple[int, int]:
        """The two sequences the model sees: prompt + chosen, prompt + rejected."""
        return self.prompt + self.chosen, self.prompt + self.rejected

    @property
    def tokens(self) -> int:
        return sum(self.sequences)

    @property
    def longest(self) -> int:
        return max(self.sequences)


@dataclass(frozen=True)
class MicroBatch:
    """The pairs (trace indices) one rank trains in one forward/backward, packed or padded."""

    pairs: tuple[int, ...]
    padded: bool


def preference_trace(num_pairs: int, seed: int, *, prompt_median: float = 150, answer_median: float = 250,
                     prompt_sigma: float = 1.0, answer_sigma: float = 0.9, max_prompt: int = 2048,
                     max_answer: int = 4096) -> list[Pair]:
    """``num_pairs`` pairs, the prompt and both answers drawn independently, log-normal (the median
    and sigma of the log), clipped to ``8..max_prompt`` and ``4..max_answer``; seeded."""
    rng = random.Random(seed)

    def draw(median: float, sigma: float, low: int, high: int) -> int:
        return min(high, max(low, round(rng.lognormvariate(0.0, sigma) * median)))

    return [Pair(draw(prompt_median, prompt_sigma, 8, max_prompt), draw(answer_median, answer_sigma, 4, max_answer),
                 draw(answer_median, answer_sigma, 4, max_answer)) for _ in range(num_pairs)]


def static_shards(num_pairs: int, world_size: int, seed: int) -> list[list[int]]:
    """A seeded shuffle dealt round robin, as DistributedSampler deals it."""
    order = list(range(num_pairs))
    random.Random(seed).shuffle(order)
    return [order[rank::world_size] for rank in range(world_size)]


def padded_batch_size(pairs: list[Pair], max_tokens: int) -> int:
    """The largest fixed B with 2B rows x the trace's longest sequence within ``max_tokens``."""
    longest = max(p.longest for p in pairs)
    if 2 * longest > max_tokens:
        raise SystemExit(f"error: the longest pair's two rows of {longest} tokens exceed --max_tokens {max_tokens}; "
                         "raise --max_tokens or lower --max_prompt / --max_answer")
    return max_tokens // (2 * longest)


def padded_batches(pairs: list[Pair], world_size: int, max_tokens: int, seed: int) -> list[list[MicroBatch]]:
    """(b): B pairs a micro-batch, B fixed (:func:`padded_batch_size`), in each shard's order."""
    size = padded_batch_size(pairs, max_tokens)
    return [[MicroBatch(tuple(shard[i:i + size]), True) for i in range(0, len(shard), size)]
            for shard in static_shards(len(pairs), world_size, seed)]


def grouped_batches(pairs: list[Pair], world_size: int, max_tokens: int, seed: int,
                    bucket_size: int) -> list[list[MicroBatch]]:
    """(c): each shard's buckets sorted longest first, cut into the most pairs that fit the budget."""
    out = []
    for shard in static_shards(len(pairs), world_size, seed):
        batches = []
        for start in range(0, len(shard), bucket_size):
            bucket = sorted(shard[start:start + bucket_size], key=lambda i: -pairs[i].longest)
            while bucket:  # (sorted: the first pair's longest sequence is the micro-batch's)
                count = max(1, max_tokens // (2 * pairs[bucket[0]].longest))
                batches.append(MicroBatch(tuple(bucket[:count]), True))
                bucket = bucket[count:]
        out.append(batches)
    return out


def odb_batches(pairs: list[Pair], world_size: int, max_tokens: int, seed: int) -> list[list[MicroBatch]]:
    """(a): odb's batcher over simulated ranks, a pair one sample of chosen + rejected tokens; a
    dummy micro-batch is an empty one (it keeps its position)."""
    config = OdbConfig(max_tokens=max_tokens, seed=seed)
    result = simulate(config, [(p.tokens, 0) for p in pairs], world_size)
    return [[MicroBatch(tuple(uid % len(pairs) for uid in micro.uids), False)
             for step in steps for micro in step.micro_batches] for steps in result.steps]


def _cost(pairs: list[Pair], micro: MicroBatch) -> tuple[int, int, int]:
    """Real tokens, materialized tokens and attention area (sum of squared row lengths)."""
    sequences = [n for i in micro.pairs for n in pairs[i].sequences]
    if not micro.padded:
        return sum(sequences), sum(sequences), sum(n * n for n in sequences)
    longest = max(sequences, default=0)
    return sum(sequences), len(sequences) * longest, len(sequences) * longest * longest


def metrics(pairs: list[Pair], ranks: list[list[MicroBatch]]) -> dict:
    """One system's figures over every rank's micro-batches (see the module docstring)."""
    model = LLAMA2_7B

    def flops(micro: MicroBatch) -> float:
        _, materialized, area = _cost(pairs, micro)
        return step_flops(matmul_params=model.compute_params, layers=model.layers, hidden=model.hidden,
                          tokens=materialized, attn_area=area) if micro.pairs else 0.0

    micro = [m for rank in ranks for m in rank if m.pairs]
    trained = sorted(i for m in micro for i in m.pairs)
    assert trained == list(range(len(pairs))), "every pair once an epoch"
    real = materialized = 0
    for m in micro:
        r, t, _ = _cost(pairs, m)
        real, materialized = real + r, materialized + t
    positions = max(len(rank) for rank in ranks)
    critical = sum(max(flops(rank[p]) if p < len(rank) else 0.0 for rank in ranks) for p in range(positions))
    return {"pairs": len(pairs), "micro_batches": len(micro), "positions": positions,
            "pairs_per_micro_batch": round(len(pairs) / len(micro), 3),
            "largest_micro_batch": max(_cost(pairs, m)[1] for m in micro),
            "real_tokens": real, "materialized_tokens": materialized,
            "padding_ratio": round(1 - real / materialized, 4),
            "materialized_per_pair": round(materialized / len(pairs), 1),
            "compute_pflop": round(sum(flops(m) for m in micro) / 1e15, 2),
            "critical_pflop": round(critical / 1e15, 2)}


def run(args: argparse.Namespace) -> dict:
    """The trace, and every system's :func:`metrics` at every world size, with ratios over odb."""
    pairs = preference_trace(args.pairs, args.seed, prompt_median=args.prompt_median,
                             answer_median=args.answer_median, max_prompt=args.max_prompt, max_answer=args.max_answer)
    build = {"odb": lambda w: odb_batches(pairs, w, args.max_tokens, args.seed),
             "padded": lambda w: padded_batches(pairs, w, args.max_tokens, args.seed),
             "grouped": lambda w: grouped_batches(pairs, w, args.max_tokens, args.seed, args.bucket_size)}
    out = {"pairs": len(pairs), "seed": args.seed, "max_tokens": args.max_tokens, "trace": trace_stats(pairs),
           "padded_batch_size": padded_batch_size(pairs, args.max_tokens), "world_sizes": {}}
    for world in args.world_sizes:
        rows = {name: metrics(pairs, build[name](world)) for name in SYSTEMS}
        for row in rows.values():
            row["compute_vs_odb"] = round(row["compute_pflop"] / rows["odb"]["compute_pflop"], 3)
            row["critical_vs_odb"] = round(row["critical_pflop"] / rows["odb"]["critical_pflop"], 3)
        out["world_sizes"][str(world)] = rows
    return out


def recount(run_dir: Path) -> dict:
    """A real run's pairs/s (its summary's), micro-batches, and padding counted from its audit."""
    import tempfile

    from odb.data.processing import SampleDataset
    from odb.training.model.build import load_tokenizer

    summary = json.loads((run_dir / "summary.json").read_text())
    config = summary["config"]
    cap, is_padded = config["batching"]["max_tokens"], config["batching"]["policy"] != "odb"
    with tempfile.TemporaryDirectory(prefix="bench_preference_") as cache:
        data = SampleDataset(config["data"]["path"], load_tokenizer(config["model"]["tokenizer"]), pairs=True,
                             cache_dir=cache)
        lengths = [tuple(min(cap, int(n)) for n in data[i]["pair"]) for i in range(len(data))]
    real = materialized = micro_batches = 0
    for audit in sorted(run_dir.glob("emitted_ids.rank*.jsonl")):
        for line in audit.read_text().splitlines():
            sequences = [n for i in json.loads(line)["ids"] for n in lengths[i]]
            if sequences:
                micro_batches += 1
                real += sum(sequences)
                materialized += len(sequences) * max(sequences) if is_padded else sum(sequences)
    assert real == summary["real_tokens"], (real, summary["real_tokens"])  # the audit is the whole run
    pairs = summary["samples_emitted"]
    return {"run": str(run_dir), "policy": config["batching"]["policy"], "batch_size": config["batching"]["batch_size"],
            "steps": summary["steps"], "pairs": pairs, "micro_batches": micro_batches,
            "pairs_per_micro_batch": round(pairs / micro_batches, 2), "wall_s": summary["wall_s"],
            "pairs_per_s": summary["samples_per_s"], "padding_ratio": round(1 - real / materialized, 4),
            "summary_padding_ratio": summary["padding_ratio"], "materialized_per_pair": round(materialized / pairs, 1)}


def trace_stats(pairs: list[Pair]) -> dict:
    def stats(values: list[int]) -> dict:
        values = sorted(values)
        return {"mean": round(sum(values) / len(values)), "p50": values[len(values) // 2],
                "p99": values[int(len(values) * 0.99)], "max": values[-1]}

    answers = [n for p in pairs for n in (p.chosen, p.rejected)]
    return {"prompt": stats([p.prompt for p in pairs]), "answer": stats(answers),
            "sequence": stats([n for p in pairs for n in p.sequences]), "pair": stats([p.tokens for p in pairs])}


def markdown(result: dict) -> str:
    lines = ["| ranks | system | pairs / micro-batch | padding | materialized tokens / pair | micro-batches "
             "(positions) | compute / epoch (PFLOP, vs odb) | critical path (PFLOP, vs odb) |", "|" + "---|" * 8]
    for world, rows in result["world_sizes"].items():
        for name, r in rows.items():
            lines.append(f"| {world} | {name} | {r['pairs_per_micro_batch']:.2f} | {r['padding_ratio']:.3f} | "
                         f"{r['materialized_per_pair']:.0f} | {r['micro_batches']} ({r['positions']}) | "
                         f"{r['compute_pflop']:.1f} ({r['compute_vs_odb']:.2f}x) | "
                         f"{r['critical_pflop']:.1f} ({r['critical_vs_odb']:.2f}x) |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=16000)
    parser.add_argument("--max_tokens", type=int, default=16384, help="tokens a micro-batch (padding included)")
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--bucket_size", type=int, default=1024, help="pairs a sorted bucket (grouped)")
    parser.add_argument("--prompt_median", type=float, default=150)
    parser.add_argument("--answer_median", type=float, default=250)
    parser.add_argument("--max_prompt", type=int, default=2048)
    parser.add_argument("--max_answer", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0, help="the trace's, the shards' and odb's")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--recount", type=Path, nargs="+", metavar="RUN",
                        help="instead: real runs' padding from their --audit_ids files (the module docstring)")
    args = parser.parse_args(argv)
    if args.pairs < max(args.world_sizes) or min(args.world_sizes) < 1 or args.bucket_size < 1:
        parser.error("need --pairs >= every world size >= 1 and --bucket_size >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.recount:
        rows = [recount(run_dir) for run_dir in args.recount]
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        print("\n".join("| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows))
        if args.json:
            print(json.dumps(rows))
        return {"runs": rows}
    result = run(args)
    t = result["trace"]
    print(f"trace: {result['pairs']} pairs, seed {result['seed']}; tokens mean/p50/p99/max: "
          + "; ".join(f"{k} {v['mean']}/{v['p50']}/{v['p99']}/{v['max']}" for k, v in t.items())
          + f"; max_tokens {result['max_tokens']}, padded B {result['padded_batch_size']}")
    print(markdown(result))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
