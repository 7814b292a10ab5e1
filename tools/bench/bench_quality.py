#!/usr/bin/env python
"""Time to quality: how soon each batching system trains the model to a target validation loss,
at equal tokens per optimizer step.

    python tools/bench/bench_quality.py --trace ../shared/traces/sharegpt4o_like.txt --length_scale 8 \\
        --samples 300 --max_tokens 2048 --world_size 2 --epochs 8 --json

Systems (``--systems``, in this order by default): ``fixed`` (padded batches of the budget-safe
size), ``gmt`` (the offline token-budget oracle), ``paper_pkg`` (the paper's package,
``online-dynamic-batching`` 0.1.2) and ``odb``, each run as tools/bench/bench_train.py runs it. What they
share: the initial weights, the training samples, the learning-rate schedule by samples (warmup,
cosine decay over ``--epochs`` epochs), and the tokens per optimizer step, within 5%: each system's
``gas`` is chosen (:func:`size_steps`) from its micro-batches per epoch, which the tool knows before
training (odb's own batcher, simulated, for fixed, gmt and odb; the paper package's loader, run
without a model, for paper_pkg). As every run trains the same tokens, equal tokens per step is an
equal number of optimizer steps. The samples themselves differ by system only in how they group.

Validation: ``--val_samples`` held-out records (the ones after the training samples), scored every
``eval_steps`` optimizer steps (the same for every system, ``--eval_points`` scores a run) and at the
end by odb's exact evaluator (:class:`odb.training.run.evaluate.Evaluator`: every label token of the set
weighs the same, however the samples are packed): in the run for the project's systems
(launch/train.py ``--eval_data``), and for paper_pkg on the weights it saved at the same steps
(tools/bench/eval_snapshots.py, the same evaluator on the same samples). Time is training time: the sum
of the steps' wall times (launch/train.py's ``step_s``; paper_pkg's loop less its saving), without
the evaluations.

Targets: three validation losses, by default 50%, 80% and 95% of the way from the initial weights'
loss down to the highest of the systems' best losses, so that every system reaches them and the
times compare (``--targets`` sets them; the best loss of each is reported beside). Per system it reports
the training time and optimizer steps to each target (``null`` where never reached), the best
validation loss, samples/s (training time) and the tokens per step it had, and for the project's
systems where the training time went (``step_breakdown_s``: data wait, planning, collective,
forward, the rest); ``--passes N`` runs each system N times, the systems in turn, and keeps its fastest pass
(load from other work only slows a run; every pass's times to the targets are in
``pass_time_to_target_s``); ``--png`` plots validation loss against training time.
``--plot A.json B.json ... --png FILE`` draws the
plot of several saved results (``--json_out``), one panel each.

``--json`` prints, as the last line of stdout, ``{"targets": [l1, l2, l3], "systems": {name:
{"time_to_target_s": [...], "steps_to_target": [...], "best_val_loss", "samples_per_s",
"tokens_per_step", ...}}, ...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench import bench_train  # noqa: E402  (tools/: after the path)

SYSTEMS = ("fixed", "gmt", "paper_pkg", "odb")
TARGET_SHARES = (0.5, 0.8, 0.95)  # of the way from the initial loss to the highest best loss
TOLERANCE = 0.03  # the tokens per step sized to within this of odb's (what the runs reach: within 5%)


# ---- the workload ----------------------------------------------------------------------------

def split_records(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The training records (``--samples``) and the held-out validation records after them
    (``--val_samples``), as two JSONL files."""
    need = args.samples + args.val_samples
    if args.trace is not None:
        from tools.make.make_trace_data import write_records
        from tools.traces import read_lengths

        lengths = [max(1, tokens // args.length_scale) for tokens, _ in read_lengths(str(args.trace))[:need]]
        source = work / "records.jsonl"
        write_records(lengths, source, seed=args.seed)
    else:
        source = args.data
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    if len(lines) < need:
        raise SystemExit(f"bench_quality: {source} has {len(lines)} records; --samples {args.samples} and "
                         f"--val_samples {args.val_samples} need {need}")
    train, val = work / "train.jsonl", work / "val.jsonl"
    train.write_text("\n".join(lines[:args.samples]) + "\n")
    val.write_text("\n".join(lines[args.samples:need]) + "\n")
    return train, val


def run_steps(system: str, gas: int, args: argparse.Namespace, shared: dict) -> int:
    """Optimizer steps of ``system``'s run at ``gas``, over every epoch: odb's batcher simulated
    over the samples' lengths for fixed, gmt and odb (as the runs configure it); for paper_pkg,
    its loader's batches in each epoch (the most of any rank), ``gas`` to a step, an epoch's last
    step short."""
    if system == "paper_pkg":
        return sum(math.ceil(batches / gas) for batches in shared["paper_batches"])
    from odb.batching.simulate import simulate

    result = simulate(bench_train.project_config(system, args, shared, gas=gas), shared["simulated"],
                      args.world_size, num_epochs=args.epochs)
    return len(result.steps[0])


def size_steps(args: argparse.Namespace, shared: dict) -> dict[str, dict]:
    """Each system's ``gas``, so that its optimizer steps carry as many tokens as odb's (the run's
    tokens over its steps: equal tokens per step is equal steps): the smallest odb ``gas`` (the
    most steps) at which every other system has a ``gas`` within ``TOLERANCE`` of odb's tokens per
    step (else the closest found), each with its steps and tokens per step."""
    run_tokens = args.epochs * sum(shared["lengths"].values())
    known: dict[tuple[str, int], int] = {}

    def steps(system: str, gas: int) -> int:
        if (system, gas) not in known:
            known[system, gas] = run_steps(system, gas, args, shared)
        return known[system, gas]

    best: tuple[float, dict] | None = None
    for odb_gas in ([args.odb_gas] if args.odb_gas else range(1, 9)):
        target = steps("odb", odb_gas)
        sizes = {"odb": odb_gas}
        for system in args.systems:
            if system != "odb":  # the gas whose steps come closest; steps fall as gas grows
                guess = max(1, round(odb_gas * steps(system, 1) / steps("odb", 1)))
                near = range(max(1, guess - 2), guess + 3)
                sizes[system] = min(near, key=lambda g, s=system: abs(target / steps(s, g) - 1))
        worst = max(abs(target / steps(s, g) - 1) for s, g in sizes.items())
        if best is None or worst < best[0]:
            best = (worst, sizes)
        if worst <= TOLERANCE:
            break
    assert best is not None
    return {s: {"gas": g, "steps": steps(s, g), "tokens_per_step": round(run_tokens / steps(s, g), 1)}
            for s, g in best[1].items()}


# ---- running ---------------------------------------------------------------------------------

def run_system(system: str, args: argparse.Namespace, shared: dict, work: Path, size: dict, eval_steps: int) -> dict:
    """One training run of ``system``; returns its figures and its validation curve."""
    extra = {}
    if system == "paper_pkg":
        out = bench_train.run_paper(args, shared, work, extra=[
            "--epochs", str(args.epochs), "--gas", str(size["gas"]), "--snapshot_steps", str(eval_steps)])
        evaluate_snapshots(args, shared, work, out / "snapshots", out / "snapshot_evals.json")
        rows = json.loads((out / "snapshot_evals.json").read_text())
        curve = [(r["trained_s"], r["step"], r["eval_loss"]) for r in rows if r["step"] > 0]
        summary = json.loads((out / "summary.json").read_text())
        trained_s = summary["wall_s"]  # (its saving not counted)
        tokens_per_step = round(summary["real_tokens"] / max(1, summary["steps"]), 1)
    else:
        out = bench_train.run_project(system, args, shared, work, settings={"gas": size["gas"]}, extra=[
            "--epochs", str(args.epochs), "--eval_data", str(shared["val"]), "--eval_steps", str(eval_steps)])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        step_s = dict(sorted((r["step"], r["step_s"]) for r in rows if "step_s" in r))
        elapsed = dict(zip(step_s, itertools.accumulate(step_s.values())))  # training time after each step
        # an evaluation after step r["step"] (0-based)
        curve = [(round(elapsed[r["step"]], 4), r["step"] + 1, r["eval_loss"]) for r in rows if "eval_loss" in r]
        summary = json.loads((out / "summary.json").read_text())
        trained_s = sum(step_s.values())
        tokens_per_step = summary["tokens_per_step"]["mean"]
        extra["step_breakdown_s"] = breakdown([r for r in rows if "step_s" in r])
    return {"trained_s": round(trained_s, 3), "steps": summary["steps"], "samples": summary["samples_emitted"],
            "samples_per_s": round(summary["samples_emitted"] / max(1e-9, trained_s), 3),
            "tokens_per_step": tokens_per_step, "gas": size["gas"], "padding_ratio": summary["padding_ratio"], **extra,
            **({"batch_size": shared["safe_batch"]} if system == "fixed" else {}), "curve": curve}


def breakdown(steps: list[dict]) -> dict:
    """Where a run's training time went, in seconds over its steps (launch/train.py's metrics rows):
    waiting for processed samples, odb's own planning, its round collective (waiting for the
    other ranks included), the micro-batches' forward passes (collate and loss included), and the
    rest of the step (backward with its gradient reduction, optimizer). Each part is the slowest
    rank's and the step rank 0's, so at several ranks the parts may overlap and ``rest`` is only
    what is left of rank 0's steps."""
    parts = {"data_wait": sum(r["data_wait_s"] for r in steps), "planning": sum(r["odb_plan_s"] for r in steps),
             "collective": sum(r["odb_collective_s"] for r in steps), "forward": sum(r["forward_s"] for r in steps)}
    return {**{k: round(v, 3) for k, v in parts.items()},
            "rest": round(sum(r["step_s"] for r in steps) - sum(parts.values()), 3)}


def evaluate_snapshots(args: argparse.Namespace, shared: dict, work: Path, snapshots: Path, out: Path) -> None:
    """tools/bench/eval_snapshots.py on one rank: odb's evaluator over ``snapshots`` (and the initial weights)."""
    one_rank = argparse.Namespace(**{**vars(args), "world_size": 1})
    bench_train._launch(sys.executable, ROOT / "tools" / "bench" / "eval_snapshots.py", [
        "--model", str(shared["model"]), "--data", str(shared["data"]), "--eval_data", str(shared["val"]),
        "--max_tokens", str(args.max_tokens), "--snapshots", str(snapshots), "--out", str(out)],
        one_rank, work / f"{out.stem}.log")


def initial_loss(args: argparse.Namespace, shared: dict, work: Path) -> float:
    """The validation loss of the initial weights (what every curve starts from)."""
    folder = work / "initial"
    folder.mkdir(exist_ok=True)
    (folder / "snapshots.json").write_text("[]")
    evaluate_snapshots(args, shared, work, folder, folder / "evals.json")
    return json.loads((folder / "evals.json").read_text())[0]["eval_loss"]


# ---- figures ---------------------------------------------------------------------------------

def reach(curve: list, target: float) -> tuple[float | None, int | None]:
    """The training time and steps of the first evaluation at or under ``target`` (None, None: never)."""
    for seconds, step, loss in curve:
        if loss is not None and loss <= target:
            return seconds, step
    return None, None


def targets_for(initial: float, best: list[float], shares=TARGET_SHARES) -> list[float]:
    """``shares`` of the way from ``initial`` down to the highest of ``best``: losses that every
    system reaches, so that the times compare."""
    low = max(best)
    return [round(initial - share * (initial - low), 4) for share in shares]


def summarize(result: dict, targets: list[float] | None) -> dict:
    """Adds the targets and, per system, the time and steps to each, and its best loss."""
    systems = result["systems"]
    for row in systems.values():
        losses = [loss for _, _, loss in row["curve"] if loss is not None]
        row["best_val_loss"] = round(min(losses), 4) if losses else None
    best = [r["best_val_loss"] for r in systems.values() if r["best_val_loss"] is not None]
    if targets is None and not best:
        raise SystemExit("bench_quality: no validation loss (no label token in the validation records?)")
    if targets is None:
        targets = targets_for(result["initial_val_loss"], best)
    result["targets"] = targets
    for row in systems.values():
        reached = [reach(row["curve"], t) for t in targets]
        row["time_to_target_s"] = [None if s is None else round(s, 2) for s, _ in reached]
        row["steps_to_target"] = [step for _, step in reached]
        if "pass_curves" in row:  # every pass's (the spread a single figure carries)
            row["pass_time_to_target_s"] = [[None if s is None else round(s, 2) for s, _ in
                                             (reach(curve, t) for t in targets)] for curve in row["pass_curves"]]
    return result


def markdown(result: dict) -> str:
    targets = result["targets"]
    head = " | ".join(f"to {t:.3f}: s (steps)" for t in targets)
    lines = [f"| system | gas | tokens/step | {head} | best val loss | samples/s | padding |",
             "|" + "---|" * (6 + len(targets))]
    for name, r in result["systems"].items():
        label = f"fixed (batch {r['batch_size']})" if "batch_size" in r else name
        cells = " | ".join("missed" if s is None else f"{s:.1f} ({n})"
                           for s, n in zip(r["time_to_target_s"], r["steps_to_target"]))
        best = "-" if r["best_val_loss"] is None else f"{r['best_val_loss']:.3f}"
        lines.append(f"| {label} | {r['gas']} | {r['tokens_per_step']:.0f} | {cells} | {best} | "
                     f"{r['samples_per_s']:.2f} | {r['padding_ratio']:.3f} |")
    split = {name: r["step_breakdown_s"] for name, r in result["systems"].items() if "step_breakdown_s" in r}
    if split:  # the project's systems: where the training time went
        parts = list(next(iter(split.values())))
        lines += ["", "| system | training s | " + " | ".join(f"{p} s" for p in parts) + " |",
                  "|" + "---|" * (2 + len(parts))]
        lines += [f"| {name} | {result['systems'][name]['trained_s']:.1f} | "
                  + " | ".join(f"{row[p]:.1f}" for p in parts) + " |" for name, row in split.items()]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Validation loss against training time, one panel per result, a line per system, the
    targets dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(results))
    rows = math.ceil(len(results) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax, result in zip(axes.flat, results):
        for name, r in result["systems"].items():
            points = [(0.0, result["initial_val_loss"])] + [(s, loss) for s, _, loss in r["curve"] if loss is not None]
            ax.plot(*zip(*points), marker=".", label=name)
        for t in result["targets"]:
            ax.axhline(t, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{result['data']}, {result['world_size']} rank(s), {result['epochs']} epochs")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation loss")
        ax.legend()
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- the command -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="a length trace (one 'tokens [patches]' line per sample)")
    source.add_argument("--data", type=Path, help="chat records (default: the bundled data/chat.jsonl)")
    source.add_argument("--plot", type=Path, nargs="+", help="only plot these saved results (--json_out) to --png")
    parser.add_argument("--samples", type=int, default=300, help="training samples: the first N")
    parser.add_argument("--val_samples", type=int, default=64, help="validation samples: the N after them")
    parser.add_argument("--max_tokens", type=int, default=2048, help="the token budget per micro-batch")
    parser.add_argument("--length_scale", type=int, default=1, help="divide the trace's lengths by this")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--world_size", type=int, default=1, choices=(1, 2, 4, 8))
    parser.add_argument("--window", type=int, default=256, help="odb's window = the paper package's buffer")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--eval_points", type=int, default=24, help="about this many evaluations a run")
    parser.add_argument("--odb_gas", type=int, default=0, help="odb's gas (0: the smallest that the others match)")
    parser.add_argument("--targets", type=float, nargs=3, help="the three target losses (default: see above)")
    parser.add_argument("--passes", type=int, default=1, help="runs per system; the fastest is kept")
    parser.add_argument("--png", type=Path, help="plot validation loss against training time here")
    parser.add_argument("--json_out", type=Path, help="save the result here (for --plot)")
    args = bench_train.parse_run_arguments(parser, argv, SYSTEMS)
    if args.plot:
        if args.png is None:
            parser.error("--plot needs --png")
        return args
    if args.trace is None and args.data is None:
        args.data = ROOT / "data" / "chat.jsonl"
    for flag in ("samples", "val_samples", "max_tokens", "length_scale", "window", "num_workers", "epochs",
                 "eval_points", "passes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if "odb" not in args.systems:
        parser.error("--systems must include odb: the others' tokens per step are sized to its")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.plot:
        plot([json.loads(p.read_text()) for p in args.plot], args.png)
        return None
    with tempfile.TemporaryDirectory(prefix="bench_quality_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        train, val = split_records(args, work)
        shared = bench_train.prepare(argparse.Namespace(**{**vars(args), "trace": None, "data": train}), work)
        shared["val"] = val
        shared["simulated"] = [(shared["lengths"][i], 0) if i in shared["lengths"] else None
                               for i in range(shared["dataset_size"])]
        if "paper_pkg" in args.systems:
            shared["paper_batches"] = bench_train.count_paper_batches(args, shared, work, args.epochs)
        sizes = size_steps(args, shared)
        eval_steps = max(1, round(sizes["odb"]["steps"] / args.eval_points))
        print(f"bench_quality: {json.dumps(sizes)}; evaluating every {eval_steps} steps", file=sys.stderr, flush=True)
        result = {"data": str(args.trace.name if args.trace else args.data.name), "samples": shared["dataset_size"],
                  "val_samples": args.val_samples, "world_size": args.world_size, "max_tokens": args.max_tokens,
                  "length_scale": args.length_scale, "epochs": args.epochs, "eval_steps": eval_steps, "lr": args.lr,
                  "initial_val_loss": initial_loss(args, shared, work), "systems": {}}
        passes = {system: [] for system in args.systems}
        for p in range(args.passes):  # the systems in turn, pass by pass: a slow spell of the machine
            for system in args.systems:  # then falls on one pass of several systems, not on one system
                print(f"bench_quality: {system} (pass {p + 1} of {args.passes}) ...", file=sys.stderr, flush=True)
                passes[system].append(run_system(system, args, shared, work, sizes[system], eval_steps))
        for system, runs in passes.items():
            fastest = min(runs, key=lambda r: r["trained_s"])
            result["systems"][system] = {**fastest, "pass_trained_s": [r["trained_s"] for r in runs],
                                         "pass_curves": [r["curve"] for r in runs]}
    summarize(result, args.targets)
    print(markdown(result))
    if args.png:
        plot([result], args.png)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
