"""Per-step metrics and run totals, with no collective of their own: each rank's figures ride on
the next round.

Every step's structure is known to every rank from its plan (tokens and costs of every rank's
micro-batches, samples, N_step). What only a rank knows (its loss, padding, time waiting for data,
in odb's planning and in the collective; its skipped records) goes into a fixed-size int64
report (:func:`report_layout`) that :class:`odb.batching.batcher.OnlineBatcher` appends to its next
round's vector; when that round's gather arrives, rank 0 completes the steps reported in it and
writes them to ``metrics.jsonl`` (and W&B). The steps of the last round are completed by the run's
one final collective (:meth:`odb.batching.align.Aligner.gather_reports`), whose vector is the
report followed by the rank's run totals (:data:`TOTALS`).

In a report, loss sums are in millionths, times in microseconds; ``aux_sum_micro`` is a
mixture-of-experts model's router loss times real tokens summed over the rank's micro-batches
(:class:`odb.training.engine.StepResult` ``aux_sum``; -1: no router loss), which makes the row's
``aux_loss``: the step's token-weighted router loss over all ranks (:mod:`odb.training.moe`);
``epoch`` is the latest epoch of the rank's samples in the step (``uid // dataset_size``), or -1
for dummies only, so that a quota-mode step, whose samples may come from a later pass, is
labelled by its data; ``fetched``
counts the records this rank has processed over the whole run, ``lost`` those of them that will
never train (skipped, or dropped over the cap), ``truncated_samples`` / ``truncated_tokens`` the
samples cut to fit ``max_tokens`` and the tokens cut from them, wherever the cut happened (in the
data workers, or by the cost model). Every rank gets every report, so the run-wide
figures derived from them (:attr:`Telemetry.fetched`, :attr:`Telemetry.lost`) are identical on
every rank and may steer the run (the learning-rate schedule plans by what will train).

Run totals: each rank counts what it trained over the whole run (kept across resumes through
:meth:`Telemetry.state_dict`) and, apart, in this process; the final gather sums them into
``summary.json`` (:meth:`Telemetry.summary`). Evaluations (:meth:`Telemetry.record_eval`) are
rows of their own in ``metrics.jsonl`` (``eval_loss``), written after the training rows of the
steps before them.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from odb.batching.plan import StepPlan
from odb.batching.wire import Layout
from odb.data.formats import SKIP_REASONS

__all__ = ["TOTALS", "StepTimes", "Telemetry", "report_layout"]

_STEP_FIELDS = ("loss_sum_micro", "materialized", "wait_us", "plan_us", "collective_us", "epoch", "aux_sum_micro")
_COUNTS = ("micro_batches", "dummy_micro_batches", "samples", "real_tokens", "materialized_tokens",
           "label_tokens", "steps", "wall_us")
TOTALS = Layout(scalars=_COUNTS + ("dropped",))
"""A rank's run totals in the final gather: its whole-run counts, and its batcher's dropped samples."""
_RECORDS = ("fetched", "lost", "truncated_samples", "truncated_tokens")
TRUNCATION_WARNING_SHARE = 0.05
"""Warn (once, rank 0) when more than this share of the samples, or of their tokens, is cut."""


def report_layout(max_steps: int) -> Layout:
    """A rank's report for one round, room for ``max_steps`` steps: the steps it trained since the
    last round (``num_steps`` from ``first_step``, each a slot of every per-step array) and its
    whole-run record counts (``skipped`` by reason, in :data:`odb.data.formats.SKIP_REASONS`
    order, ``fetched``, ``lost``, ``truncated_samples``, ``truncated_tokens``)."""
    return Layout(scalars=("num_steps", "first_step", *_RECORDS),
                  arrays={"skipped": len(SKIP_REASONS), **dict.fromkeys(_STEP_FIELDS, max_steps)})


@dataclass
class StepTimes:
    """A rank's own seconds for one step."""

    wait: float  # waiting for processed samples
    plan: float  # odb: packing, decisions, dealing
    collective: float  # inside odb's round collective
    step: float  # wall time of the whole step
    ended: float  # time.time() at its end


@dataclass
class _Step:
    plan: StepPlan
    loss_sum: float
    lr: float
    times: StepTimes
    aux_sum: float | None = None  # MoE: sum over micro-batches of router loss x real tokens


class Telemetry:
    """One rank's side of the metrics and run totals; rank 0 also writes the metrics.

    Args:
        max_steps_per_round: the most steps a round can plan (window + lookahead over GAS, + 1).
        max_tokens: the micro-batch budget (for budget fill).
        dataset_size: for epochs done.
        output_dir: where rank 0 writes ``metrics.jsonl``.
        sink: rank 0's extra consumer of each metrics dict (e.g. W&B's ``log``), or None.
    """

    def __init__(self, *, rank: int, max_steps_per_round: int, max_tokens: int, dataset_size: int,
                 output_dir: Path, sink=None) -> None:
        self.rank, self.max_steps = rank, max_steps_per_round
        self.max_tokens, self.dataset_size = max_tokens, dataset_size
        self.sink = sink
        self.layout = report_layout(max_steps_per_round)
        self.pending: list[_Step] = []  # trained, not yet reported
        self.reported: list[_Step] = []  # reported, not yet gathered
        self.skipped: dict[str, int] = {}  # over all ranks and the whole run, as of the last round
        self.fetched = self.lost = 0  # over all ranks and the whole run, as of the last round
        self.truncated = {"samples": 0, "tokens": 0}  # over all ranks and the whole run, as of the last round
        self.evals: list[dict[str, Any]] = []  # rank 0: eval rows not yet written
        self.last_eval: dict[str, Any] | None = None  # the latest evaluation's row
        self.losses: list[float] = []  # rank 0: the global loss per token of each step with labels
        self.last: dict[str, Any] = {}  # rank 0: the last metrics row
        # The run's progress (the same on every rank) and this rank's totals, resumes included.
        self.samples_done = self.steps_done = 0
        self.totals = dict.fromkeys(_COUNTS, 0)
        self.first_losses: list[float] = []  # the run's first global step losses, from before a resume
        self.skipped_before: Counter[str] = Counter()  # this rank's skipped records before a resume
        self.truncated_before: Counter[str] = Counter()  # this rank's data-worker cuts before a resume
        self.zero_label_steps = 0  # steps whose samples had no label token at all (the same on every rank)
        self._warned_truncation = False
        self.this_process = {"steps": 0, "samples": 0, "rounds": 0, "wall_s": 0.0}
        self._rows_samples_done = 0  # rank 0: samples_done as of the last row written
        self._started: float | None = None  # while the train loop runs
        self.file = open(output_dir / "metrics.jsonl", "a") if rank == 0 else None

    # ---- the train loop -------------------------------------------------------------------

    def start(self) -> None:
        """The train loop begins (its time counts into ``wall_s``)."""
        self._started = time.perf_counter()

    def stop(self) -> None:
        """The train loop has ended."""
        if self._started is not None:
            self.this_process["wall_s"] = time.perf_counter() - self._started
            self.totals["wall_us"] += round(self.this_process["wall_s"] * 1e6)
            self._started = None

    def record(self, plan: StepPlan, *, loss_sum: float, lr: float, times: StepTimes,
               aux_sum: float | None = None) -> None:
        """This rank trained ``plan`` (call once per step, in order); ``aux_sum``: a MoE model's
        router loss times real tokens over this rank's micro-batches, None for a dense model."""
        self.pending.append(_Step(plan, loss_sum, lr, times, aux_sum))
        self.samples_done += plan.num_samples
        self.steps_done = plan.step + 1
        self.this_process["steps"] += 1
        self.this_process["samples"] += plan.num_samples
        if plan.num_samples and not plan.num_label_tokens:
            self.zero_label_steps += 1
            if self.rank == 0:
                print(f"odb: WARNING: step {plan.step} has {plan.num_samples} samples and no label token on any "
                      "rank: it trains nothing", file=sys.stderr, flush=True)
        t = self.totals
        t["steps"] += 1
        for micro in plan.micro_batches:
            t["label_tokens"] += micro.label_tokens
            t["micro_batches"] += not micro.is_dummy
            t["dummy_micro_batches"] += micro.is_dummy
            t["samples"] += len(micro.samples)
            t["real_tokens"] += micro.tokens
            t["materialized_tokens"] += micro.materialized

    # ---- reports --------------------------------------------------------------------------

    def report(self, skipped: Mapping[str, int], **records: int) -> np.ndarray:
        """This rank's vector for the next round: the steps trained since the last one, and its
        whole-run record counts (``skipped``: this process's, by reason; ``records``: ``fetched``,
        ``lost``, ``truncated_samples``, ``truncated_tokens``, whole-run)."""
        return self.layout.encode(**self._report_fields(skipped, records))

    def _report_fields(self, skipped: Mapping[str, int], records: Mapping[str, int]) -> dict[str, Any]:
        assert len(self.pending) <= self.max_steps, "more steps between rounds than a round plans"
        steps, skipped = self.pending, self.skipped_before + Counter(skipped)
        size = max(1, self.dataset_size)
        self.reported, self.pending = self.pending, []
        return {
            "num_steps": len(steps), "first_step": steps[0].plan.step if steps else -1,
            **{name: records.get(name, 0) for name in _RECORDS},
            "skipped": [skipped.get(r, 0) for r in SKIP_REASONS],
            "loss_sum_micro": [round(s.loss_sum * 1e6) for s in steps],
            "materialized": [sum(m.materialized for m in s.plan.micro_batches) for s in steps],
            "wait_us": [round(s.times.wait * 1e6) for s in steps],
            "plan_us": [round(s.times.plan * 1e6) for s in steps],
            "collective_us": [round(s.times.collective * 1e6) for s in steps],
            "epoch": [max((u // size for m in s.plan.micro_batches for u in m.uids), default=-1) for s in steps],
            "aux_sum_micro": [-1 if s.aux_sum is None else round(s.aux_sum * 1e6) for s in steps]}

    def on_reports(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """Every rank's report of a round ``[world, len]``: rank 0 completes and writes the steps
        it covers."""
        if reports.shape[1] == 0:
            return []
        self.this_process["rounds"] += 1
        return self._complete(self.layout.decode(reports))

    def complete_gathered(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """After a failed round: completes the steps of its gathered ``reports`` if they are this
        rank's reported steps (else nothing); local, no collective."""
        if not self.reported or reports.shape[1] != self.layout.size:
            return []
        fields = self.layout.decode(reports)
        return self._complete(fields) if self._covers(fields) else []

    def _covers(self, fields: dict[str, np.ndarray]) -> bool:
        first = self.reported[0].plan.step if self.reported else -1
        return bool((fields["num_steps"] == len(self.reported)).all() and (fields["first_step"] == first).all())

    def _complete(self, fields: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        self.skipped = {r: int(v) for r, v in zip(SKIP_REASONS, fields["skipped"].sum(axis=0)) if v}
        self.fetched, self.lost = int(fields["fetched"].sum()), int(fields["lost"].sum())
        self.truncated = {"samples": int(fields["truncated_samples"].sum()),
                          "tokens": int(fields["truncated_tokens"].sum())}
        assert self._covers(fields), "ranks reported different steps"
        reported, self.reported = self.reported, []
        if self.rank != 0:  # only rank 0 writes the rows
            return []
        rows = [self._metrics(step, {name: fields[name][:, i] for name in _STEP_FIELDS})
                for i, step in enumerate(reported)]
        self._write(rows)
        self._write_evals(up_to=rows[-1]["step"] if rows else -1)
        self._warn_truncation()
        return rows

    def _write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
            if self.sink is not None:
                self.sink(row)
        self.file.flush()

    def _write_evals(self, up_to: int | None = None) -> None:
        """Writes the eval rows of steps up to ``up_to`` (None: all), after those steps' rows (they
        arrive in step order, so the ready ones lead)."""
        ready = [row for row in self.evals if up_to is None or row["step"] <= up_to]
        self.evals = self.evals[len(ready):]
        self._write(ready)

    def _warn_truncation(self) -> None:
        samples = self.truncated["samples"]
        if self._warned_truncation or samples <= TRUNCATION_WARNING_SHARE * max(20, self.fetched):
            return
        self._warned_truncation = True
        print(f"odb: WARNING: {samples} of {self.fetched} samples so far were longer than max_tokens="
              f"{self.max_tokens} and were cut ({self.truncated['tokens']} tokens lost); raise max_tokens in "
              "the odb config, or see the data setting truncation ('turns' keeps whole assistant turns)",
              file=sys.stderr, flush=True)

    def record_eval(self, step: int, *, loss: float | None, label_tokens: int, samples: int, seconds: float,
                    over_cap: int = 0) -> None:
        """An evaluation after step ``step`` (the same on every rank); rank 0 writes its row once
        the training rows up to that step are written. ``loss`` None (an eval set without label
        tokens) is written as null, as JSON has no NaN; ``over_cap``: samples over the cap, scored whole."""
        row = {"step": step, "eval_loss": None if loss is None else round(loss, 6), "eval_label_tokens": label_tokens,
               "eval_samples": samples, "eval_over_cap": over_cap, "eval_s": round(seconds, 3),
               "time": round(time.time(), 3)}
        self.last_eval = row
        if self.rank == 0:
            self.evals.append(row)

    def _metrics(self, step: _Step, per_rank: dict[str, np.ndarray]) -> dict[str, Any]:
        plan, step_s = step.plan, step.times.step
        rank_costs = np.array(plan.rank_costs)  # [micro, world]
        rank_tokens = np.array(plan.rank_tokens)
        real = int(rank_tokens.sum())
        materialized = int(per_rank["materialized"].sum())
        micro = int((rank_tokens > 0).sum())
        per_rank_tokens = rank_tokens.sum(axis=0)
        self._rows_samples_done += plan.num_samples
        slowest = rank_costs.max(axis=1).sum()
        loss = float(per_rank["loss_sum_micro"].sum()) / 1e6 / max(1, plan.num_label_tokens)
        if plan.num_label_tokens:
            self.losses.append(loss)
        latest = int(per_rank["epoch"].max())
        row = {
            "step": plan.step, "epoch": latest if latest >= 0 else plan.epoch, "time": round(step.times.ended, 3),
            "loss": round(loss, 6),
            **self._aux_loss(per_rank["aux_sum_micro"], real),
            "lr": step.lr, "samples": plan.num_samples, "samples_done": self._rows_samples_done,
            "epochs_done": round(self._rows_samples_done / max(1, self.dataset_size), 4),
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
            "data_wait_s": float(per_rank["wait_us"].max()) / 1e6, "odb_plan_s": float(per_rank["plan_us"].max()) / 1e6,
            "odb_collective_s": float(per_rank["collective_us"].max()) / 1e6, "skipped": dict(self.skipped),
            "truncated_samples": self.truncated["samples"], "truncated_tokens": self.truncated["tokens"],
        }
        self.last = row
        return row

    @staticmethod
    def _aux_loss(aux_sum_micro: np.ndarray, real_tokens: int) -> dict[str, float]:
        """MoE: ``aux_loss`` = sum over ranks and micro-batches of router loss x real tokens, over the
        step's real tokens; nothing for a dense model (every rank reports -1)."""
        if (aux_sum_micro < 0).any():
            return {}
        return {"aux_loss": round(float(aux_sum_micro.sum()) / 1e6 / max(1, real_tokens), 6)}

    # ---- the end of the run -----------------------------------------------------------------

    def final_report(self, skipped: Mapping[str, int], *, dropped: int, **records: int) -> np.ndarray:
        """This rank's vector for the final gather: its last report, then its run totals."""
        fields = self._report_fields(skipped, records)
        return self.layout.then(TOTALS).encode(**fields, **self.totals, dropped=dropped)

    def on_final_reports(self, gathered: np.ndarray) -> dict[str, int]:
        """Every rank's final vector: completes the last round's steps; returns the run totals
        summed over ranks."""
        fields = self.layout.then(TOTALS).decode(gathered)
        self._complete(fields)
        if self.rank == 0:
            self._write_evals()  # the evaluations after the last round's steps
        return {name: int(fields[name].sum()) for name in TOTALS.scalars}

    def summary(self, totals: Mapping[str, int], *, world_size: int, epochs: int | None, rounds: int,
                collectives: int, policy: str) -> dict[str, Any]:
        """The whole run's figures (resumes included), and this process's apart.

        Args:
            totals: :meth:`on_final_reports`'s sums.
            epochs: the planned epochs (join mode), or None to count them from the samples trained.
            rounds: the run's rounds so far; ``collectives``: this process's.
        """
        wall_s = totals["wall_us"] / 1e6 / world_size  # every rank's train loop, averaged
        losses = self.first_losses or self.losses  # global per-step losses (rank 0)
        last = self.losses[-3:] or losses[-3:]
        mine = self.this_process
        if epochs is None:
            epochs = round(totals["samples"] / max(1, self.dataset_size), 4)
        cut = self.truncated
        cut_share = cut["tokens"] / max(1, cut["tokens"] + totals["real_tokens"])
        if self.rank == 0 and (cut_share > TRUNCATION_WARNING_SHARE
                               or cut["samples"] > TRUNCATION_WARNING_SHARE * max(1, self.fetched)):
            print(f"odb: WARNING: {cut['samples']} samples were cut to max_tokens={self.max_tokens}, losing "
                  f"{cut['tokens']} tokens ({cut_share:.1%} of their tokens); raise max_tokens in the odb config",
                  file=sys.stderr, flush=True)
        return {
            "world_size": world_size, "dataset_samples": self.dataset_size, "epochs": epochs,
            "steps": self.steps_done, "micro_batches": totals["micro_batches"],
            "dummy_micro_batches": totals["dummy_micro_batches"], "samples_emitted": totals["samples"],
            "real_tokens": totals["real_tokens"], "materialized_tokens": totals["materialized_tokens"],
            "padding_ratio": round(1 - totals["real_tokens"] / max(1, totals["materialized_tokens"]), 6),
            "label_tokens": totals["label_tokens"], "truncated_samples": cut["samples"],
            "truncated_tokens": cut["tokens"], "dropped": totals["dropped"], "skipped": self.skipped,
            "zero_label_steps": self.zero_label_steps,
            "eval_loss": self.last_eval["eval_loss"] if self.last_eval else None,
            "loss_first": round(sum(losses[:3]) / max(1, len(losses[:3])), 5),
            "loss_last": round(sum(last) / max(1, len(last)), 5),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(totals["samples"] / max(1e-9, wall_s), 3),
            "tokens_per_s": round(totals["real_tokens"] / max(1e-9, wall_s), 1),
            "policy": policy, "rounds": rounds,
            "this_process": {
                "steps": mine["steps"], "samples": mine["samples"], "rounds": mine["rounds"],
                "odb_collectives": collectives,  # start check + one per round + the final gather
                "wall_s": round(mine["wall_s"], 3),
                "samples_per_s": round(mine["samples"] / max(1e-9, mine["wall_s"]), 3)},
        }

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self, skipped: Mapping[str, int], truncated: Mapping[str, int]) -> dict[str, Any]:
        """The run's progress and this rank's whole-run counts (``skipped``, ``truncated``: this
        process's data-worker counts), for a checkpoint; JSON-able."""
        running = round((time.perf_counter() - self._started) * 1e6) if self._started is not None else 0
        return {"samples_done": self.samples_done, "steps_done": self.steps_done,
                "totals": {**self.totals, "wall_us": self.totals["wall_us"] + running},
                "skipped": dict(self.skipped_before + Counter(skipped)),
                "truncated": dict(self.truncated_before + Counter(truncated)),
                "zero_label_steps": self.zero_label_steps, "last_eval": self.last_eval,
                "first_losses": (self.first_losses or self.losses)[:3],
                "fetched_lost": [self.fetched, self.lost]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues the counts of a checkpoint's :meth:`state_dict` (a resumed run)."""
        self.samples_done = self._rows_samples_done = state["samples_done"]
        self.steps_done = state["steps_done"]
        self.totals.update(state["totals"])
        self.skipped_before = Counter(state["skipped"])
        self.truncated_before = Counter(state.get("truncated", {}))
        self.zero_label_steps = state.get("zero_label_steps", 0)
        self.last_eval = state.get("last_eval")
        self.first_losses = list(state["first_losses"])
        self.fetched, self.lost = state["fetched_lost"]

    @staticmethod
    def redeal_states(states: list[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Every old rank's :meth:`state_dict` as ``world_size`` new ranks' (a resume on another number
        of ranks): what each rank counted for itself (its totals, skipped and truncated records) is
        summed on new rank 0, so the run's sums stay; the train-loop time is the old ranks' mean on
        every new rank, so its mean stays; the run's progress is every rank's alike."""
        totals = {k: sum(s["totals"][k] for s in states) for k in states[0]["totals"]}
        wall_us = totals["wall_us"] // len(states)
        out = []
        for r in range(world_size):
            mine = totals if r == 0 else dict.fromkeys(totals, 0)
            out.append({**states[0], "totals": {**mine, "wall_us": wall_us},
                        "skipped": dict(sum((Counter(s["skipped"]) for s in states), Counter())) if r == 0 else {},
                        "truncated": dict(sum((Counter(s.get("truncated", {})) for s in states), Counter()))
                        if r == 0 else {}})
        return out

    def close(self) -> None:
        """Flushes and closes ``metrics.jsonl`` (local; safe to call twice)."""
        if self.file is not None:
            self.file.close()
            self.file = None
