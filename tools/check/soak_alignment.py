#!/usr/bin/env python
"""Soak the alignment: simulated ranks plan a million samples; memory and planning time stay flat.

    python tools/check/soak_alignment.py                       # 1,000,000 samples, 8 ranks, lognormal lengths
    python tools/check/soak_alignment.py --trace ../shared/traces/ultrachat_like.txt --out soak.png --json

Every rank runs the real :class:`~odb.batching.batcher.OnlineBatcher` over a
:class:`~odb.batching.simulate.SimulatedFeed` (samples are ``(tokens, label_tokens, patches)``
tuples, no tokenizer) on one :class:`~odb.batching.align.SimulatedGroup`. The dataset is
``--dataset_size`` samples (a ``--trace`` tiled to that size, or seeded lognormal lengths); join
mode runs ``--samples / --dataset_size`` epochs, quota mode streams until ``--samples``. uids are
``epoch * dataset_size + index``, so the uid space grows with every epoch: a structure keyed by
uid that is never emptied shows up here as growing memory.

Every ``--interval`` samples rank 0 records: samples done, time per sample over the interval
(``plan``: every rank's :attr:`OnlineBatcher.plan_s` summed, per trained sample; ``cpu``: the
process's CPU time; ``wall``: wall time; the probe's own time left out of all three; the
simulated collectives' time is not planning: there it is the wait for the other ranks' turns),
process RSS, tracemalloc
current/peak (``--tracemalloc``; it slows the run about 5x), live gc objects, and the largest size
over ranks and over the interval of the structures that could grow (planned-step queue, packer
window and bins, stream pending, feed queue, feed's forgotten list), sampled once a round, when
rank 0 starts on the round's steps (the other ranks may be anywhere in their next round).

The summary fits a least-squares line to every interval but the first (warm-up) and calls the
run *flat* when the line's growth over the run stays within ``--rss_tol_mb`` (``--trace_tol_mb``;
live gc objects: ``2 * ranks * (window + lookahead)``, twice the in-flight samples), the median
CPU us/sample of the later half of those intervals is within ``--time_tol`` of the earlier
half's (CPU time and medians: other jobs on a shared machine make wall and planning times
jumpy), and no structure ever held more than ``window + lookahead`` entries.

With ``--json`` the last line of stdout is one JSON object (see :func:`run` for its keys);
``--out FILE.png`` plots RSS and us/sample over samples; ``--profile N`` prints the N hottest
functions (cProfile in every rank's thread, merged, by own time) to stderr; lock ``acquire`` at
the top is the ranks waiting for their turn, not work.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import pstats
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odb.batching.align import SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import SimulatedFeed

SIZE_KEYS = ("queue_steps", "window_samples", "bins", "stream_pending", "feed_queue", "feed_forgotten")
"""Structures that could grow, each measured as its largest size over ranks."""


def rss_mb() -> float:
    """Resident set size of this process now, in MB (psutil, else /proc; else the peak)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 1e6
    except ImportError:
        pass
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # kB on Linux; the peak


def make_lengths(trace: str | None, dataset_size: int, seed: int) -> list[tuple[int, int]]:
    """``(tokens, patches)`` per dataset index: the trace (``tokens [patches]`` a line) tiled to
    ``dataset_size``, or seeded lognormal lengths (median 1000 tokens, CV about 0.66)."""
    if trace:
        rows = [line.split() for line in Path(trace).read_text().splitlines() if line.strip()]
        base = [(int(r[0]), int(r[1]) if len(r) > 1 else 0) for r in rows]
        if not base:
            raise SystemExit(f"error: --trace {trace} holds no sample")
        return [base[i % len(base)] for i in range(dataset_size)]
    tokens = np.random.default_rng(seed).lognormal(math.log(1000), 0.6, dataset_size)
    return [(int(t), 0) for t in np.clip(np.rint(tokens), 8, None)]


@dataclass
class RankTally:
    """What one rank trained, in O(1) memory: enough to check alignment and exact-once sums."""

    steps: int = 0
    micro_batches: int = 0
    bad_steps: int = 0  # steps without exactly GAS micro-batches
    samples: int = 0
    uid_sum: int = 0
    uid_sq_sum: int = 0


@dataclass
class Probe:
    """Rank 0's periodic measurements (rank 0 holds the baton meanwhile: the other ranks wait)."""

    interval: int
    batchers: list
    feeds: list
    done: int = 0
    next_mark: int = 0
    records: list[dict] = field(default_factory=list)
    _last: dict[str, float] = field(default_factory=dict)  # the counters at the previous record
    _round_seen: int = -1
    _max_sizes: dict[str, int] = field(default_factory=dict)  # over the interval, sampled once a round

    def start(self) -> None:
        self.next_mark = self.interval
        self._last = self.counters()

    def counters(self) -> dict[str, float]:
        """Cumulative samples, wall and process CPU time, and every rank's planning and fetch time."""
        started = all(b is not None for b in self.batchers)
        return {"samples": self.done, "wall": time.perf_counter(), "cpu": time.process_time(),
                "plan": sum(b.plan_s for b in self.batchers) if started else 0.0,
                "fetch": sum(b.fetch_s for b in self.batchers) if started else 0.0}

    def on_step(self, num_samples: int, is_last: bool = False) -> None:
        if self.batchers[0].round_index != self._round_seen:  # the first step of a new round
            self._round_seen = self.batchers[0].round_index
            for key, size in self.sizes().items():
                self._max_sizes[key] = max(self._max_sizes.get(key, 0), size)
        self.done += num_samples
        if self.done >= self.next_mark or is_last:
            self.record()
            self.next_mark = (self.done // self.interval + 1) * self.interval

    def sizes(self) -> dict[str, int]:
        """The largest size over ranks of each structure that could grow (:data:`SIZE_KEYS`)."""
        return {
            "queue_steps": max(len(b.queue) for b in self.batchers),
            "window_samples": max(b.packer.num_samples for b in self.batchers),
            "bins": max(len(b.packer.bins) for b in self.batchers),
            "stream_pending": max(len(b.stream.pending) for b in self.batchers),
            "feed_queue": max(len(f.queue) for f in self.feeds),
            "feed_forgotten": max(len(f.forgotten) for f in self.feeds),
        }

    def record(self) -> None:
        now, last = self.counters(), self._last
        count = max(1, self.done - last["samples"])
        per_sample = {f"{key}_us": round((now[key] - last[key]) / count * 1e6, 3)
                      for key in ("plan", "fetch", "wall", "cpu")}
        sizes, self._max_sizes = self._max_sizes or self.sizes(), {}
        current, peak = tracemalloc.get_traced_memory() if tracemalloc.is_tracing() else (None, None)
        stream = self.batchers[0].stream
        self.records.append({
            "samples": self.done, "epochs": round(stream.stream_pos / stream.dataset_size, 2),
            "rounds": self.batchers[0].round_index, **per_sample, "rss_mb": round(rss_mb(), 2),
            "traced_mb": None if current is None else round(current / 1e6, 3),
            "traced_peak_mb": None if peak is None else round(peak / 1e6, 3),
            "gc_objects": len(gc.get_objects()), **sizes})
        self._last = self.counters()  # after the probe: its own time counts in no interval


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def summarize(records: list[dict], args: argparse.Namespace, inflight: int) -> dict:
    """First vs last interval, slopes over every interval but the first (warm-up), and the verdict."""
    fit = records[1:] if len(records) > 2 else records
    xs = [r["samples"] for r in fit]
    span = (xs[-1] - xs[0]) if xs else 0
    out: dict = {"first": records[0], "last": records[-1], "fit_from_samples": xs[0] if xs else 0}
    problems = []

    def growth(key: str) -> float:
        per_sample = slope(xs, [r[key] for r in fit])
        out[f"{key}_per_1m_samples"] = round(per_sample * 1e6, 4)
        return per_sample * span  # growth the line predicts over the fitted span

    rss_growth = growth("rss_mb")
    if rss_growth > args.rss_tol_mb:
        problems.append(f"RSS grows {rss_growth:.1f} MB over {span} samples (tolerance {args.rss_tol_mb} MB)")
    for key in ("plan_us", "wall_us", "cpu_us"):  # slopes for the record; the verdict below
        growth(key)
    # Time: process CPU per sample (what other jobs on a shared machine disturb least), median of
    # the second half of the fitted intervals against the first half's (robust to load bursts).
    half = len(fit) // 2
    if half:
        early = float(np.median([r["cpu_us"] for r in fit[:half]]))
        late = float(np.median([r["cpu_us"] for r in fit[half:]]))
        out["cpu_us_change"] = round(late / early - 1, 4) if early else 0.0
        if early and late / early - 1 > args.time_tol:
            problems.append(f"CPU us/sample grows {late / early - 1:.0%} from the first half to the second "
                            f"(medians {early:.2f} -> {late:.2f}; tolerance {args.time_tol:.0%})")
    if fit and fit[0]["traced_mb"] is not None:
        traced = growth("traced_mb")
        if traced > args.trace_tol_mb:
            problems.append(f"traced memory grows {traced:.2f} MB (tolerance {args.trace_tol_mb} MB)")
    for key in SIZE_KEYS:  # every one holds samples, bins or steps of what is in flight
        out[f"max_{key}"] = biggest = max(r[key] for r in records)
        if biggest > inflight:
            problems.append(f"{key} reached {biggest}, above window + lookahead = {inflight}")
    # Live objects swing by about a window per rank with the phase of the rounds at each record:
    # allow twice that (a leak of one object in 50 samples still shows over a million samples).
    objects, objects_tol = growth("gc_objects"), 2 * args.ranks * inflight
    if objects > objects_tol:
        problems.append(f"live gc objects grow by {objects:.0f} over the run (tolerance {objects_tol})")
    out["tolerances"] = {"rss_mb": args.rss_tol_mb, "time_rel": args.time_tol, "traced_mb": args.trace_tol_mb,
                         "structures": f"<= window + lookahead = {inflight}",
                         "gc_objects": objects_tol}
    out["verdict"] = "growing" if problems else "flat"
    out["problems"] = problems
    return out


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["samples"] / 1e3 for r in records]
    fig, (mem, time_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    mem.plot(xs, [r["rss_mb"] for r in records], marker="o", label="RSS")
    if records[0]["traced_mb"] is not None:
        mem.plot(xs, [r["traced_mb"] for r in records], marker=".", label="tracemalloc current")
    mem.set_ylabel("MB")
    mem.set_ylim(bottom=0)
    mem.legend()
    time_ax.plot(xs, [r["plan_us"] for r in records], marker="o", label="planning (all ranks)")
    time_ax.plot(xs, [r["cpu_us"] for r in records], marker=".", label="process CPU")
    time_ax.plot(xs, [r["wall_us"] for r in records], marker=".", label="wall")
    time_ax.set_ylabel("us / sample (interval)")
    time_ax.set_ylim(bottom=0)
    time_ax.set_xlabel("samples planned (thousands)")
    time_ax.legend()
    fig.suptitle("odb alignment soak")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000, help="samples to plan over all ranks")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--mode", choices=("join", "quota"), default="join",
                        help="join: --samples / --dataset_size epochs; quota: one stream, quota --samples")
    parser.add_argument("--dataset_size", type=int, default=50_000,
                        help="samples per epoch (join mode: must divide --samples)")
    parser.add_argument("--trace", help="lengths, one sample a line: tokens [vision_patches] (tiled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=int, default=50_000, help="samples between measurements")
    parser.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations (slower)")
    parser.add_argument("--rss_tol_mb", type=float, default=16.0,
                        help="allowed RSS growth over the run (a leak of one int per sample is 28+ MB per 1M)")
    parser.add_argument("--time_tol", type=float, default=0.25, help="allowed relative growth of us/sample")
    parser.add_argument("--trace_tol_mb", type=float, default=2.0, help="allowed tracemalloc growth")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N hottest functions")
    parser.add_argument("--out", help="plot RSS and us/sample over samples to this PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.ranks < 1 or args.interval < 1 or args.dataset_size < 1:
        parser.error("--samples, --ranks, --interval and --dataset_size must be >= 1")
    if args.mode == "join":
        args.dataset_size = min(args.dataset_size, args.samples)
        if args.samples % args.dataset_size:
            parser.error(f"--mode join plans whole epochs: --dataset_size {args.dataset_size} must divide "
                         f"--samples {args.samples}; change one of them or use --mode quota")
    return args


def run(argv: list[str] | None = None) -> dict:
    """Runs the soak; returns the report: settings, ``samples_done``, ``wall_s``, ``aligned``,
    ``exact_once`` (join mode: count and uid sums match every epoch's indices), ``intervals`` (one
    dict per measurement) and ``summary`` (first, last, slopes, tolerances, ``verdict``)."""
    args = parse_args(argv)
    try:
        config = OdbConfig(max_tokens=args.max_tokens, window=args.window, gas=args.gas, mode=args.mode,
                           quota=args.samples if args.mode == "quota" else None, seed=args.seed)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    lengths = make_lengths(args.trace, args.dataset_size, args.seed)
    num_epochs = args.samples // args.dataset_size if args.mode == "join" else 1
    probe = Probe(args.interval, [None] * args.ranks, [None] * args.ranks)
    profiles = [cProfile.Profile() for _ in range(args.ranks)] if args.profile else []

    def rank_main(comm) -> RankTally:
        if profiles:
            profiles[comm.rank].enable()
        feed = SimulatedFeed(lengths)
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=feed, num_epochs=num_epochs)
        probe.batchers[comm.rank], probe.feeds[comm.rank] = batcher, feed
        tally = RankTally()
        for step in batcher:  # steps are counted and dropped: the tool itself keeps nothing per step
            tally.steps += 1
            tally.micro_batches += len(step.micro_batches)
            tally.bad_steps += len(step.micro_batches) != config.gas
            for micro in step.micro_batches:
                for sample in micro.samples:
                    tally.samples += 1
                    tally.uid_sum += sample.uid
                    tally.uid_sq_sum += sample.uid * sample.uid
            if comm.rank == 0:
                probe.on_step(step.num_samples, is_last=batcher.is_done and not batcher.queue)
        if profiles:
            profiles[comm.rank].disable()
        return tally

    if args.tracemalloc:
        tracemalloc.start()
    gc.collect()
    start = time.perf_counter()
    probe.start()
    tallies = SimulatedGroup(args.ranks, timeout_s=24 * 3600.0).run(rank_main)
    wall_s = time.perf_counter() - start
    if args.tracemalloc:
        tracemalloc.stop()

    trained = sum(t.samples for t in tallies)
    report = {
        "samples": args.samples, "samples_done": probe.done, "samples_trained": trained, "ranks": args.ranks,
        "mode": args.mode, "epochs": round(probe.batchers[0].stream.stream_pos / args.dataset_size, 2),
        "dataset_size": args.dataset_size, "trace": args.trace or "lognormal(median 1000, sigma 0.6)",
        "max_tokens": args.max_tokens, "window": args.window, "gas": args.gas, "seed": args.seed,
        "tracemalloc": args.tracemalloc, "wall_s": round(wall_s, 2),
        "us_per_sample_wall": round(wall_s / max(1, trained) * 1e6, 3),
        "us_per_sample_plan": round(sum(b.plan_s for b in probe.batchers) / max(1, trained) * 1e6, 3),
        "rounds": probe.batchers[0].round_index,
        "aligned": len({(t.steps, t.micro_batches) for t in tallies}) == 1 and not any(t.bad_steps for t in tallies),
        "truncated": sum(b.counts["truncated"] for b in probe.batchers),
        "dropped": sum(b.counts["dropped"] for b in probe.batchers),
    }
    if args.mode == "join":
        n, epochs = args.dataset_size, num_epochs
        # every uid e * n + i (e < epochs, i < n) once: closed forms of their count, sum and sum of squares
        want_sum = epochs * n * (n - 1) // 2 + n * n * epochs * (epochs - 1) // 2
        want_sq = sum((e * n) ** 2 * n + 2 * e * n * (n * (n - 1) // 2) + (n - 1) * n * (2 * n - 1) // 6
                      for e in range(epochs))
        report["exact_once"] = (trained == n * epochs and sum(t.uid_sum for t in tallies) == want_sum
                                and sum(t.uid_sq_sum for t in tallies) == want_sq)
    else:
        report["exact_once"] = None  # quota mode: exactly --samples trained, uids across epochs
    report["intervals"] = probe.records
    report["summary"] = summarize(probe.records, args, inflight=config.window + config.lookahead)
    if args.out:
        plot(probe.records, args.out)
    if profiles:
        stats = pstats.Stats(profiles[0], stream=(buffer := io.StringIO()))
        for profile in profiles[1:]:
            stats.add(profile)
        stats.sort_stats("tottime").print_stats(args.profile)
        print(buffer.getvalue(), file=sys.stderr)
    return report


def table(report: dict) -> str:
    """The intervals as a markdown table (for docs/benchmarks.md)."""
    traced = report["tracemalloc"]
    head = ("| samples | plan us/sample | CPU us/sample | wall us/sample | RSS MB |"
            + (" traced MB |" if traced else "") + " window samples / queued steps / pending uids (max over ranks) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["intervals"]:
        lines.append(f"| {r['samples']:,} | {r['plan_us']:.1f} | {r['cpu_us']:.1f} | {r['wall_us']:.1f} | "
                     f"{r['rss_mb']:.1f} |"
                     + (f" {r['traced_mb']:.2f} |" if traced else "")
                     + f" {r['window_samples']} / {r['queue_steps']} / {r['stream_pending']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Runs :func:`run`, prints the table and the summary (and the JSON report last, with ``--json``)."""
    report = run(argv)
    s = report["summary"]
    print(table(report))
    print(f"\n{report['samples_done']:,} samples ({report['samples_trained']:,} trained) on {report['ranks']} ranks, "
          f"{report['epochs']} epochs, {report['rounds']} rounds, in {report['wall_s']} s; aligned "
          f"{report['aligned']}, exact once {report['exact_once']}")
    print(f"first interval: {s['first']['plan_us']} us/sample planning, {s['first']['rss_mb']} MB RSS; "
          f"last: {s['last']['plan_us']} us/sample, {s['last']['rss_mb']} MB")
    print(f"slopes per 1M samples (from {s['fit_from_samples']:,}): RSS {s['rss_mb_per_1m_samples']} MB, "
          f"planning {s['plan_us_per_1m_samples']} us, CPU {s['cpu_us_per_1m_samples']} us, wall "
          f"{s['wall_us_per_1m_samples']} us; CPU us/sample, later vs earlier half: {s.get('cpu_us_change', 0):+.1%}")
    print(f"verdict: {s['verdict']}" + "".join(f"\n  - {p}" for p in s["problems"]))
    if "--json" in (sys.argv[1:] if argv is None else argv):
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
