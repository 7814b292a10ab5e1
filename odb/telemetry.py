"""Per-step metrics with no collective of their own: each rank's figures ride on the next round.

Every step's structure is known to every rank from its plan (tokens and costs of every rank's
micro-batches, samples, N_step). What only a rank knows (its loss, padding, time waiting for data,
in odb's planning and in the collective; its skipped records) goes into a fixed-size int64
report that :class:`odb.batching.batcher.OnlineBatcher` appends to its next round's vector; when that
round's gather arrives, rank 0 completes the steps reported in it and writes them to
``metrics.jsonl`` (and W&B). The steps of the last round are completed by the run's one final
collective (:meth:`odb.batching.align.Aligner.gather_reports`).

Report layout: ``[steps, skipped by reason..., fetched, lost, then per step: loss_sum_micro,
materialized, wait_us, plan_us, collective_us, epoch]`` (loss sums in millionths; ``epoch``: the
latest epoch of the rank's samples in the step (``uid // dataset_size``), or -1 for dummies only,
so that a quota-mode step, whose samples may come from a later pass, is labelled by its data; ``fetched``: records
this rank has processed over the whole run, ``lost``: those of them that will never train,
skipped or dropped over the cap). Every rank gets every report, so the run-wide figures derived
from them (:attr:`Telemetry.fetched`, :attr:`Telemetry.lost`) are identical on every rank and
may steer the run (the learning-rate schedule plans by what will train).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from odb.data.processing import SKIP_REASONS
from odb.batching.plan import StepPlan

__all__ = ["Telemetry", "StepTimes"]

_PER_STEP = 6
_HEAD = 1 + len(SKIP_REASONS) + 2  # steps, skipped by reason, fetched, lost


@dataclass
class StepTimes:
    """A rank's own seconds for one step."""

    wait: float  # waiting for processed samples
    plan: float  # odb: packing, decisions, dealing
    collective: float  # inside odb's round collective
    step: float  # wall time of the whole step
    ended: float  # time.time() at its end


class Telemetry:
    """One rank's side of the metrics; rank 0 also writes them.

    Args:
        max_steps_per_round: the most steps a round can plan (window + lookahead over GAS, + 1).
        max_tokens: the micro-batch budget (for budget fill).
        dataset_size: for epochs done.
        samples_done: samples trained before this process (a resumed run).
        output_dir: where rank 0 writes ``metrics.jsonl``.
        sink: rank 0's extra consumer of each metrics dict (e.g. W&B's ``log``), or None.
    """

    def __init__(self, *, rank: int, max_steps_per_round: int, max_tokens: int, dataset_size: int,
                 samples_done: int = 0, output_dir: Path, sink=None) -> None:
        self.rank, self.max_steps = rank, max_steps_per_round
        self.max_tokens, self.dataset_size = max_tokens, dataset_size
        self.sink = sink
        self.pending: list[tuple[StepPlan, float, float, int, StepTimes]] = []  # not yet reported
        self.reported: list[tuple[StepPlan, float, StepTimes]] = []  # reported, not yet gathered
        self.skipped: dict[str, int] = {}
        self.fetched = self.lost = 0  # over all ranks and the whole run, as of the last round
        self.losses: list[float] = []  # rank 0: the global loss per token of each step with labels
        self.samples_done = samples_done
        self.file = open(output_dir / "metrics.jsonl", "a") if rank == 0 else None
        self.last: dict[str, Any] = {}

    @property
    def size(self) -> int:
        return _HEAD + _PER_STEP * self.max_steps

    def record(self, plan: StepPlan, *, loss_sum: float, lr: float, materialized: int, times: StepTimes) -> None:
        """This rank trained ``plan`` (call once per step, in order)."""
        self.pending.append((plan, loss_sum, lr, materialized, times))

    def report(self, skipped: dict[str, int], *, fetched: int = 0, lost: int = 0) -> np.ndarray:
        """This rank's vector for the next round: the steps trained since the last one, and its
        whole-run record counts (``skipped`` by reason, ``fetched``, ``lost``)."""
        assert len(self.pending) <= self.max_steps, "more steps between rounds than a round plans"
        out = np.zeros(self.size, dtype=np.int64)
        out[0] = len(self.pending)
        out[1:1 + len(SKIP_REASONS)] = [skipped.get(r, 0) for r in SKIP_REASONS]
        out[_HEAD - 2:_HEAD] = fetched, lost
        base = _HEAD
        for i, (plan, loss_sum, _, materialized, times) in enumerate(self.pending):
            epoch = max((u // max(1, self.dataset_size) for m in plan.micro_batches for u in m.uids), default=-1)
            out[base + _PER_STEP * i:base + _PER_STEP * (i + 1)] = (
                round(loss_sum * 1e6), materialized, round(times.wait * 1e6), round(times.plan * 1e6),
                round(times.collective * 1e6), epoch)
        self.reported = [(plan, lr, times) for plan, _, lr, _, times in self.pending]
        self.pending = []
        return out

    def on_reports(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """Every rank's report: rank 0 completes and writes the steps it covers."""
        if reports.shape[1] == 0:
            return []
        base = _HEAD
        self.skipped = {r: int(v) for r, v in zip(SKIP_REASONS, reports[:, 1:base - 2].sum(axis=0)) if v}
        self.fetched, self.lost = (int(v) for v in reports[:, base - 2:base].sum(axis=0))
        assert all(int(n) == len(self.reported) for n in reports[:, 0]), "ranks reported different steps"
        reported, self.reported = self.reported, []
        if self.rank != 0:  # only rank 0 writes the rows
            return []
        rows = [self._metrics(plan, lr, times, reports[:, base + _PER_STEP * i:base + _PER_STEP * (i + 1)])
                for i, (plan, lr, times) in enumerate(reported)]
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
            if self.sink is not None:
                self.sink(row)
        self.file.flush()
        return rows

    def _metrics(self, plan: StepPlan, lr: float, times: StepTimes, per_rank: np.ndarray) -> dict[str, Any]:
        step_s = times.step
        rank_costs = np.array(plan.rank_costs)  # [micro, world]
        rank_tokens = np.array(plan.rank_tokens)
        real = int(rank_tokens.sum())
        materialized = int(per_rank[:, 1].sum())
        micro = int((rank_tokens > 0).sum())
        per_rank_tokens = rank_tokens.sum(axis=0)
        self.samples_done += plan.num_samples
        slowest = rank_costs.max(axis=1).sum()
        loss = float(per_rank[:, 0].sum()) / 1e6 / max(1, plan.num_label_tokens)
        if plan.num_label_tokens:
            self.losses.append(loss)
        latest = int(per_rank[:, 5].max())
        row = {
            "step": plan.step, "epoch": latest if latest >= 0 else plan.epoch, "time": round(times.ended, 3),
            "loss": round(loss, 6),
            "lr": lr, "samples": plan.num_samples, "samples_done": self.samples_done,
            "epochs_done": round(self.samples_done / max(1, self.dataset_size), 4),
            "label_tokens": plan.num_label_tokens, "real_tokens": real, "materialized_tokens": materialized,
            "padding_ratio": round(1 - real / materialized, 6) if materialized else 0.0,
            "budget_fill": round(real / (micro * self.max_tokens), 6) if micro else 0.0,
            "micro_batches": micro, "dummy_micro_batches": int((rank_tokens == 0).sum()),
            "rank_tokens_min": int(per_rank_tokens.min()), "rank_tokens_mean": float(per_rank_tokens.mean()),
            "rank_tokens_max": int(per_rank_tokens.max()),
            "sync_efficiency": round(float(rank_costs.mean(axis=1).sum() / slowest), 6) if slowest else 1.0,
            "step_s": round(step_s, 6),
            "samples_per_s": round(plan.num_samples / step_s, 3) if step_s else 0.0,
            "tokens_per_s": round(real / step_s, 1) if step_s else 0.0,
            "materialized_tokens_per_s": round(materialized / step_s, 1) if step_s else 0.0,
            "data_wait_s": float(per_rank[:, 2].max()) / 1e6, "odb_plan_s": float(per_rank[:, 3].max()) / 1e6,
            "odb_collective_s": float(per_rank[:, 4].max()) / 1e6, "skipped": dict(self.skipped),
        }
        self.last = row
        return row

    def close(self) -> None:
        if self.file:
            self.file.close()
