"""``odb plot``: training runs plotted from their metrics.jsonl: tokens/s, samples/s, padding,
micro-batches per step, rank balance and the training loss over steps (with the validation loss of
``--eval_data`` / ``--val_ratio`` runs as points on the loss panel), several runs overlaid.

    odb plot runs/odb runs/fixed --out runs/compare.png

Needs matplotlib (``pip install 'odb[plot]'``); it draws headless (the Agg backend).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["main"]

PANELS = [("tokens_per_s", "real tokens / s"), ("samples_per_s", "samples / s"),
          ("padding_ratio", "padding ratio"), ("micro_batches", "micro-batches per step"),
          ("rank_balance", "rank balance (min / max tokens)"), ("loss", "loss")]


def load(run: Path) -> tuple[list[dict], list[dict]]:
    """The run's step rows and its evaluation rows."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass the --output_dir of a training run")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "eval_loss" not in row]
    for row in steps:
        row["rank_balance"] = row["rank_tokens_min"] / row["rank_tokens_max"] if row["rank_tokens_max"] else 1.0
    return steps, [row for row in rows if "eval_loss" in row]


def smooth(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def main(argv: list[str] | None = None, prog: str = "odb plot") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (training --output_dir)")
    parser.add_argument("--out", type=Path, default=Path("run_plots.png"))
    parser.add_argument("--smooth", type=int, default=5, help="moving average over this many steps")
    parser.add_argument("--labels", nargs="*", help="one legend label per run (default: folder names)")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("odb plot needs matplotlib: pip install 'odb[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    labels = args.labels or [run.name for run in args.runs]
    figure, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=80)
    for run, label in zip(args.runs, labels):
        rows, evals = load(run)
        steps = [row["step"] for row in rows]
        for ax, (key, title) in zip(axes.flat, PANELS):
            line, = ax.plot(steps, smooth([float(row[key]) for row in rows], args.smooth), label=label)
            if key == "loss" and evals:
                ax.plot([row["step"] for row in evals], [row["eval_loss"] for row in evals], "o--",
                        color=line.get_color(), label=f"{label} (validation)")
                ax.legend()
            ax.set_title(title)
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
    axes.flat[0].legend()
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out)
    print(f"wrote {args.out}")

