"""Rank 0's view of the run's progress: tqdm's bar on a terminal, else one line every
``--log_steps`` steps, as other trainers print them (no terminal: a SLURM log, a pipe)::

    odb: step 40 | samples 1210/2000 (60.5%) | loss 4.8112 | lr 0.00045 | 5433 tok/s | pad 0.000 | sync 0.951 | ...

Both read the run's own figures: the bar the samples of each step, the lines each step's metrics
row (:class:`odb.telemetry.Telemetry`'s ``on_row``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from odb.batching.plan import StepPlan

__all__ = ["Progress", "clock"]


def clock(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS``."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Rank 0's progress display (make it on rank 0 only).

    Args:
        planned: the sample visits the run plans (asked at each line: a mixture's estimate moves).
        log_steps: a line every this many steps where no bar is shown (0: none).
    """

    def __init__(self, *, planned: Callable[[], int], log_steps: int) -> None:
        self.planned, self.log_steps = planned, log_steps
        self.bar = None
        self.lines = False  # a line every log_steps steps (no bar shown)
        self._began: tuple[float, int] = (0.0, 0)  # time.time() and samples done when the steps began

    def start(self, telemetry, *, bar_total: int | None = None) -> None:
        """From now on: a bar of ``bar_total`` samples (tqdm shows it only on a terminal; None: no bar),
        else the lines."""
        if bar_total is not None:
            from tqdm import tqdm

            self.bar = tqdm(total=bar_total, initial=telemetry.samples_done, unit="sample", desc="odb",
                            disable=None, dynamic_ncols=True)
        self.lines = bool(self.log_steps) and (self.bar is None or self.bar.disable)
        self._began = (time.time(), telemetry.samples_done)
        if self.lines:
            telemetry.on_row = self.on_row

    def step(self, plan: StepPlan, last: dict[str, Any]) -> None:
        """A step trained (``last``: its metrics row, once written)."""
        if self.bar is None:
            return
        self.bar.update(plan.num_samples)
        if last:
            self.bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                 pad=f"{last['padding_ratio']:.2f}", refresh=False)

    def on_row(self, row: dict[str, Any]) -> None:
        if (row["step"] + 1) % self.log_steps == 0:
            print(self.line(row), flush=True)

    def line(self, row: dict[str, Any]) -> str:
        """One step's line for a log without a terminal."""
        total = self.planned()
        began, done_before = self._began
        elapsed = max(0.0, row["time"] - began)
        done = row["samples_done"]
        rate = (done - done_before) / elapsed if elapsed > 0 else 0.0
        eta = clock((total - done) / rate) if rate > 0 and total > done else "-"
        mfu = f" | mfu {row['mfu']:.3f}" if "mfu" in row else ""
        return (f"odb: step {row['step'] + 1} | samples {done}/{total} ({100 * done / max(1, total):.1f}%) | "
                f"loss {row['loss']:.4f} | lr {row['lr']:.3g} | {row['tokens_per_s']:.0f} tok/s{mfu} | "
                f"pad {row['padding_ratio']:.3f} | sync {row['sync_efficiency']:.3f} | {clock(elapsed)} elapsed, "
                f"eta {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
