"""Per-step metrics and run totals, with no collective of their own: each rank's figures ride on
the next round.

Every step's structure is known to every rank from its plan (tokens and costs of every rank's
micro-batches, samples, N_step). What only a rank knows (its loss, padding, time waiting for data,
in odb's planning and in the collective; its skipped records) goes into an int64 report
(:mod:`odb.telemetry.reports`, sent cut to the steps it holds) that
:class:`odb.batching.batcher.OnlineBatcher` appends to its next round's vector; when that round's
gather arrives, rank 0 completes the steps reported in it (:mod:`odb.telemetry.rows`) and writes
them to ``metrics.jsonl`` and W&B (:mod:`odb.telemetry.writer`). The steps of the last round are
completed by the run's one final collective (:meth:`odb.batching.batcher.OnlineBatcher.gather_reports`),
whose vector is the report followed by the rank's run totals (:mod:`odb.telemetry.totals`).

``fetched`` counts the records the ranks have processed over the whole run, ``lost`` those of them
that will never train (skipped, or dropped over the cap), ``truncated`` the samples cut to fit
``max_tokens`` and the tokens cut from them, wherever the cut happened (in the data workers, or by
the cost model). Every rank gets every report, so these run-wide figures are identical on every
rank and may steer the run (the learning-rate schedule plans by what will train).

Run totals: each rank counts what it trained over the whole run (kept across resumes through
:meth:`Telemetry.state_dict`) and, apart, in this process; the final gather sums them into
``summary.json`` (:meth:`Telemetry.summary`). Evaluations (:meth:`Telemetry.record_eval`) are
rows of their own in ``metrics.jsonl`` (``eval_loss``), written after the training rows of the
steps before them.

A dataset of several sources (a data mixture, :meth:`Telemetry.set_sources`) adds, on the same
report and the same final gather, each source's loss and label tokens over log intervals
(``loss/<source>``, ``label_tokens/<source>`` on the interval's last row) and each source's
samples and label tokens over the run (``summary.json``'s ``sources``): :mod:`odb.telemetry.sources`.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from odb.batching.plan import StepPlan
from odb.data.formats import SKIP_REASONS
from odb.telemetry.flops import FlopsModel
from odb.telemetry.reports import STEP_FIELDS, TOTALS, Step, StepReports, StepTimes, report_layout
from odb.telemetry.rows import eval_row, step_loss, step_row
from odb.telemetry.sources import SourceIntervals, sources_summary
from odb.telemetry.totals import TRUNCATION_WARNING_SHARE, RunTotals
from odb.telemetry.writer import MetricsWriter, Superseded

__all__ = ["TOTALS", "StepTimes", "Telemetry", "first_losses", "report_layout", "step_losses"]


def step_losses(path: Path, *, before: int) -> list[float]:
    """The losses of the run's steps with labels before ``before`` (the checkpoint's: later rows are
    of steps a resume trains again), in step order, from its ``metrics.jsonl``; a step's row twice (an
    earlier resume from an older checkpoint) counts once, its last row. A line that does not parse
    (cut by a kill) is skipped; no file, no losses."""
    found: dict[int, float] = {}
    if not path.is_file():
        return []
    with open(path) as rows:
        for line in rows:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            step = row.get("step", before)
            if "loss" in row and row.get("label_tokens") and isinstance(step, int) and step < before:
                found[step] = row["loss"]
    return [found[step] for step in sorted(found)]


def first_losses(path: Path, known: list[float], *, before: int) -> list[float]:
    """The run's first (up to 3) losses (:func:`step_losses`), where its ``metrics.jsonl`` holds more
    of them than ``known`` (the checkpoint's)."""
    found = step_losses(path, before=before)[:3]
    return found if len(found) > len(known) else known


class Telemetry:
    """One rank's side of the metrics and run totals; rank 0 also writes the metrics.

    Args:
        max_steps_per_round: the most steps a round can plan (window + lookahead over GAS, + 1).
        max_tokens: the micro-batch budget (for budget fill).
        dataset_size: for epochs done.
        output_dir: where rank 0 writes ``metrics.jsonl``.
        sink: rank 0's extra consumer of each metrics dict (e.g. W&B's ``log``), or None.
        flops: the model's FLOPs per token and the device's peak, for each row's ``mfu``.
        mixture: the data is a weighted mixture: a step's epoch is its plan's, and rows carry no
            ``epochs_done`` (an epoch's length is the mixture's, not the records').
    """

    def __init__(self, *, rank: int, max_steps_per_round: int, max_tokens: int, dataset_size: int,
                 output_dir: Path, sink=None, flops: FlopsModel | None = None, mixture: bool = False) -> None:
        self.rank, self.max_tokens, self.dataset_size, self.flops = rank, max_tokens, dataset_size, flops
        self.mixture = mixture  # a weighted mixture: a uid's pass is its source's, not the epoch
        self.on_row: Callable[[dict[str, Any]], None] | None = None  # rank 0: told of each step's row once written
        self.steps = StepReports(max_steps=max_steps_per_round, dataset_size=0 if mixture else dataset_size)
        self.sources = SourceIntervals(("data",), every=1, max_steps=max_steps_per_round)
        self.layout = self.steps.layout
        self.totals = RunTotals(rank=rank, dataset_size=dataset_size)
        self.path = output_dir / "metrics.jsonl"
        self.writer = MetricsWriter(self.path, sink) if rank == 0 else None
        # the run's record counts over all ranks, as of the last round (the same on every rank)
        self.skipped: dict[str, int] = {}
        self.fetched = self.lost = 0
        self.truncated = {"samples": 0, "tokens": 0}
        self.source_totals: tuple[list[int], list[int]] | None = None  # the final gather's, several sources
        self.losses: list[float] = []  # rank 0: the global loss per token of each step with labels
        self.last: dict[str, Any] = {}  # rank 0: the last metrics row
        self.superseded: Superseded | None = None  # rank 0, resumed: an earlier process's rows moved aside
        self._rows_samples_done = 0  # rank 0: samples_done as of the last row written
        # rank 0, this process's steps: sums of the ranks' mean and slowest forward time,
        # and of the cost model's mean and slowest estimate per micro-batch position
        self._balance = np.zeros(4)
        self._warned_truncation = False

    # ---- the run's progress (the same on every rank) ------------------------------------------

    @property
    def samples_done(self) -> int:
        return self.totals.samples_done

    @property
    def steps_done(self) -> int:
        return self.totals.steps_done

    @property
    def rounds(self) -> int:
        """The rounds whose reports this process completed."""
        return self.totals.this_process["rounds"]

    def set_sources(self, names: tuple[str, ...], *, every: int) -> None:
        """The dataset's ``source_names``; with several, each source's loss over intervals of
        ``every`` steps rides on the reports (:mod:`odb.telemetry.sources`). Before the first report."""
        assert not self.steps.reported and not self.rounds, "set the sources before the first round"
        self.sources = SourceIntervals(names, every=every, max_steps=self.steps.max_steps)
        self.layout = self.steps.layout.then(self.sources.layout())
        self.totals.sources.names = names

    # ---- the train loop -------------------------------------------------------------------

    def start(self) -> None:
        """The train loop begins (its time counts into ``wall_s``)."""
        self.totals.start()

    def stop(self) -> None:
        """The train loop has ended."""
        self.totals.stop()

    def record(self, plan: StepPlan, *, loss_sum: float, lr: float, times: StepTimes,
               aux_sum: float | None = None, source_loss: tuple[float, ...] = (),
               source_label_tokens: tuple[int, ...] = (), source_samples: tuple[int, ...] = (),
               rewards: tuple[float, float, int] | None = None) -> None:
        """This rank trained ``plan`` (call once per step, in order); ``aux_sum``: a MoE model's
        router loss times real tokens over this rank's micro-batches, None for a dense model;
        ``source_*``: this rank's summed token loss, label tokens and samples per source id;
        ``rewards``: a preference objective's (:attr:`odb.training.step.objective.StepResult.rewards`)."""
        self.steps.pending.append(Step(plan, loss_sum, lr, times, aux_sum, rewards))
        self.totals.record(plan)
        self.totals.sources.record(source_samples, source_label_tokens)
        self.sources.record(plan.step, source_loss, source_label_tokens if rewards is None else source_samples,
                            pairs=rewards is not None)  # (a preference step's loss is per pair)

    def end_interval(self) -> bool:
        """The run's last per-source log interval ends at the last step recorded (every rank alike:
        the run's end, a stop, ``--max_steps``), whole or not; its figures go on its last step's row
        (:meth:`odb.telemetry.sources.SourceIntervals.close`). Returns whether one was open."""
        return self.sources.close()

    def record_eval(self, step: int, *, loss: float | None, label_tokens: int, samples: int, seconds: float,
                    over_cap: int = 0, sources: Mapping[str, tuple[float | None, int]] | None = None,
                    rewards: Mapping[str, float] | None = None) -> None:
        """An evaluation after step ``step`` (the same on every rank); rank 0 writes its row once
        the training rows up to that step are written (:func:`odb.telemetry.rows.eval_row`);
        ``sources``: per source name its eval loss and label tokens (an eval set of several sources)."""
        row = eval_row(step, loss=loss, label_tokens=label_tokens, samples=samples, seconds=seconds,
                       over_cap=over_cap, sources=sources, rewards=rewards)
        self.totals.last_eval = row
        if self.writer is not None:
            self.writer.add_eval(row)

    # ---- reports --------------------------------------------------------------------------

    def truncated_records(self, truncated: Mapping[str, int]) -> dict[str, int]:
        """This rank's whole-run data-worker cuts: ``truncated`` (this process's) and those before a resume."""
        before = self.totals.truncated_before
        return {"samples": truncated["samples"] + before["samples"], "tokens": truncated["tokens"] + before["tokens"]}

    def report(self, skipped: Mapping[str, int], **records: int) -> np.ndarray:
        """This rank's vector for the next round: the steps trained since the last one, and its
        whole-run record counts (``skipped``: this process's, by reason; ``records``: ``fetched``,
        ``lost``, ``truncated_samples``, ``truncated_tokens``, whole-run)."""
        return self.layout.pack(self.layout.encode(**self._fields(skipped, records)))  # (as it travels)

    def _fields(self, skipped: Mapping[str, int], records: Mapping[str, int]) -> dict[str, Any]:
        return {**self.steps.fields(self.totals.skipped_before + Counter(skipped), records), **self.sources.fields()}

    def on_reports(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """Every rank's report of a round ``[world, len]``: rank 0 completes and writes the steps
        it covers."""
        if reports.shape[1] == 0:
            return []
        self.totals.this_process["rounds"] += 1
        return self._complete(self.layout.unpack_matrix(reports))

    def complete_gathered(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """After a failed round: completes the steps of its gathered ``reports`` if they are this
        rank's reported steps (else nothing); local, no collective."""
        if not self.steps.reported:
            return []
        try:
            fields = self.layout.unpack_matrix(reports)
        except ValueError:  # (not this layout's reports)
            return []
        return self._complete(fields) if self.steps.covers(fields) else []

    def _complete(self, fields: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        self.skipped = {r: int(v) for r, v in zip(SKIP_REASONS, fields["skipped"].sum(axis=0)) if v}
        self.fetched, self.lost = int(fields["fetched"].sum()), int(fields["lost"].sum())
        self.truncated = {"samples": int(fields["truncated_samples"].sum()),
                          "tokens": int(fields["truncated_tokens"].sum())}
        assert self.steps.covers(fields), "ranks reported different steps"
        reported = self.steps.take_reported()
        by_source = self.sources.complete(fields)  # the rows that end a log interval: per-source figures
        if self.writer is None:  # only rank 0 writes the rows
            return []
        # an interval whose last step's row went out before it closed (a last round that planned no
        # step): a row of its own, after the steps' (odb.telemetry.sources)
        late = [{"step": step, **keys, "time": round(time.time(), 3)} for step, keys in by_source.items()
                if step not in {s.plan.step for s in reported}]
        rows = []
        for i, step in enumerate(reported):
            self._rows_samples_done += step.plan.num_samples
            per_rank = {name: fields[name][:, i] for name in STEP_FIELDS}
            costs = np.array(step.plan.rank_costs, dtype=np.float64)  # [micro, world]
            planned = (costs.mean(axis=1).sum(), costs.max(axis=1).sum()) if costs.size else (0.0, 0.0)
            self._balance += (per_rank["forward_us"].mean(), per_rank["forward_us"].max(), *planned)
            rows.append(step_row(step, per_rank, samples_done=self._rows_samples_done,
                                 dataset_size=0 if self.mixture else self.dataset_size,
                                 max_tokens=self.max_tokens, skipped=self.skipped, truncated=self.truncated,
                                 flops=self.flops, sources=by_source.get(step.plan.step)))
            if step.plan.num_label_tokens:
                self.losses.append(step_loss(step, per_rank))
        if rows:
            self.last = rows[-1]
        self.writer.write(rows + late)
        for row in rows if self.on_row is not None else ():
            self.on_row(row)
        self.writer.write_evals(up_to=rows[-1]["step"] if rows else -1)
        self._warn_truncation()
        return rows

    def _warn_truncation(self) -> None:
        samples = self.truncated["samples"]
        if self._warned_truncation or samples <= TRUNCATION_WARNING_SHARE * max(20, self.fetched):
            return
        self._warned_truncation = True
        print(f"odb: WARNING: {samples} of {self.fetched} samples so far were longer than max_tokens="
              f"{self.max_tokens} and were cut ({self.truncated['tokens']} tokens lost); raise max_tokens in "
              "the odb config, or see the data setting truncation ('turns' keeps whole assistant turns)",
              file=sys.stderr, flush=True)

    # ---- the end of the run -----------------------------------------------------------------

    def _final_layout(self):
        return self.layout.then(TOTALS).then(self.totals.sources.layout())

    def final_report(self, skipped: Mapping[str, int], *, dropped: int, **records: int) -> np.ndarray:
        """This rank's vector for the final gather: its last report, then its run totals (and its
        per-source counts, several sources)."""
        layout = self._final_layout()
        return layout.pack(layout.encode(**self._fields(skipped, records), **self.totals.counts, dropped=dropped,
                                         **self.totals.sources.fields()))

    def on_final_reports(self, gathered: np.ndarray) -> dict[str, int]:
        """Every rank's final vector: completes the last round's steps; returns the run totals
        summed over ranks (the per-source ones kept for :meth:`summary`)."""
        fields = self._final_layout().unpack_matrix(gathered)
        self._complete(fields)
        if self.writer is not None:
            self.writer.write_evals()  # the evaluations after the last round's steps
        if "run_source_samples" in fields:
            self.source_totals = (fields["run_source_samples"].sum(axis=0).tolist(),
                                  fields["run_source_label_tokens"].sum(axis=0).tolist())
        return {name: int(fields[name].sum()) for name in TOTALS.scalars}

    def summary(self, totals: Mapping[str, int], *, world_size: int, epochs: int | None, rounds: int,
                collectives: int, policy: str) -> dict[str, Any]:
        """The whole run's figures (resumes included), and this process's apart
        (:meth:`odb.telemetry.totals.RunTotals.summary`; ``totals``: :meth:`on_final_reports`'s)."""
        summary = self.totals.summary(totals, world_size=world_size, epochs=epochs, rounds=rounds,
                                      collectives=collectives, policy=policy, losses=self.losses,
                                      records={"skipped": self.skipped, "fetched": self.fetched,
                                               "truncated": self.truncated}, max_tokens=self.max_tokens)
        mean, slowest, planned_mean, planned_slowest = self._balance.tolist()
        # this process's steps (rank 0 writes the summary): measured, and as the cost model planned them
        summary["this_process"]["sync_efficiency"] = round(mean / slowest, 6) if slowest else None
        summary["this_process"]["planned_sync_efficiency"] = (round(planned_mean / planned_slowest, 6)
                                                              if planned_slowest else None)
        samples, tokens = self.source_totals or ([totals["samples"]], [totals["label_tokens"]])
        summary["sources"] = sources_summary(self.totals.sources.names, samples, tokens)
        return summary

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self, skipped: Mapping[str, int], truncated: Mapping[str, int]) -> dict[str, Any]:
        """The run's progress, this rank's whole-run counts (``skipped``, ``truncated``: this
        process's data-worker counts) and its open per-source interval, for a checkpoint; JSON-able."""
        totals = self.totals.state_dict(skipped, truncated, losses=self.losses, fetched_lost=(self.fetched, self.lost))
        return {**totals, "source_interval": self.sources.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues the counts of a checkpoint's :meth:`state_dict` (a resumed run) and its open
        per-source interval; rank 0 moves an earlier process's rows of the checkpoint's step and
        later out of ``metrics.jsonl`` (:func:`odb.telemetry.writer.supersede_rows`: steps this
        process trains again), into :attr:`superseded`."""
        self.totals.load_state_dict(state)
        self.sources.load_state_dict(state.get("source_interval"))  # (none in a checkpoint of an older odb)
        if self.writer is not None:
            self.superseded = self.writer.supersede(self.totals.steps_done)
        self._rows_samples_done = self.totals.samples_done
        self.fetched, self.lost = self.totals.fetched_lost
        if self.writer is not None and len(self.totals.first_losses) < 3:
            # steps trained before the checkpoint whose rows their run completed only later (their
            # reports ride on the next round): the run's first losses are in its metrics.jsonl
            self.totals.first_losses = first_losses(self.path, self.totals.first_losses,
                                                    before=self.totals.steps_done)
        if self.writer is not None:  # the run's last losses before this process, for a resume of < 3 steps
            self.totals.last_losses = step_losses(self.path, before=self.totals.steps_done)[-3:]

    @staticmethod
    def redeal_states(states: list[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Every old rank's :meth:`state_dict` as ``world_size`` new ranks' (a resume on another
        number of ranks: :meth:`odb.telemetry.totals.RunTotals.redeal_states`, and the open
        per-source interval's sums on new rank 0)."""
        out = RunTotals.redeal_states(states, world_size)
        intervals = SourceIntervals.redealt([s.get("source_interval") for s in states], world_size)
        return [{**state, "source_interval": interval} for state, interval in zip(out, intervals, strict=True)]

    def close(self) -> None:
        """Flushes and closes ``metrics.jsonl`` (local; safe to call twice)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

