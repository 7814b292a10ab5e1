"""The training run behind ``launch/train.py``: init -> build -> train -> finish, and shutdown.

Every rank calls the same methods in the same order. :meth:`Trainer.finish` is collective (the
final checkpoint, the gather of run totals, the summary); :meth:`Trainer.shutdown` is local and
safe after any error (DataLoader workers, files, the tracker runs, the process group), each of its
steps guarded so that one failure does not skip the rest. ``launch/train.py`` shows the calling
order: ``finish`` on success, ``shutdown`` always (with the error, if one was raised).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from odb.batching.plan import StepPlan
from odb.telemetry import StepTimes
from odb.telemetry.trackers import check_installed
from odb.training import backends
from odb.training.backends.process_group import collective_timeout_s, connect_store
from odb.training.config.settings import RunConfig
from odb.training.export import save_hf
from odb.training.run.assemble import Components, build_components, init_distributed
from odb.training.run.checkpoint import (
    load_checkpoint,
    load_plan,
    mark_finished,
    resolve_tag,
    save_checkpoint,
    saved_budgets,
)
from odb.training.run.first_round import check_first_round
from odb.training.run.progress import Progress
from odb.training.run.schedule import planned_to_train
from odb.training.run.stop import EXIT_PREEMPTED, GracefulStop, Preempted
from odb.training.run.teardown import leave_process_group, peak_memory_mb
from odb.training.run.watchdog import Watchdog
from odb.training.step.objective import StepResult

__all__ = ["Trainer"]


class Trainer:
    """One rank of a run."""

    def __init__(self, config: RunConfig, *, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.parts: Components | None = None  # after build()
        self.saved: str | None = None  # the last checkpoint tag written (or resumed from)
        self.resumed: str | None = None  # the checkpoint tag this process resumed
        self.audit: IO[str] | None = None  # emitted_ids.rank<R>.jsonl while training
        self.evaluated_at: int | None = None  # steps done at the last evaluation
        self.watchdog: Watchdog | None = None  # from init() on (odb.training.run.watchdog)
        self.stop: GracefulStop | None = None
        self.progress: Progress | None = None  # rank 0's, while training

    @classmethod
    def init(cls, config: RunConfig) -> Trainer:
        """Joins the process group (collective), starts the watchdog, handles SIGTERM / SIGUSR1 from
        now on (:mod:`odb.training.run.watchdog`) and makes the output folder. A tracker of ``--report_to``
        whose package is missing stops every rank first, naming the install command."""
        check_installed(config.logging.report_to)
        rank, world_size = init_distributed(config)
        trainer = cls(config, rank=rank, world_size=world_size)
        timeout = config.run.dist_timeout_s
        trainer.watchdog = Watchdog(connect_store(timeout), rank=rank, world_size=world_size, timeout_s=timeout,
                                    on_exit=backends.get(config.optimization.backend).release).start()
        trainer.stop = GracefulStop(connect_store(collective_timeout_s(timeout)), rank=rank).install()
        config.output_dir.mkdir(parents=True, exist_ok=True)
        return trainer

    def build(self) -> Trainer:
        """Builds every component (collective); resumes from a checkpoint if asked to, also one that
        another number of ranks saved (DeepSpeed's universal checkpoint, odb.training.backends.universal; FSDP2's
        checkpoints reshard as they load)."""
        config, plan = self.config, None
        if config.checkpoints.resume:
            tag = resolve_tag(config, config.checkpoints.resume)
            plan = load_plan(config, tag, rank=self.rank, world_size=self.world_size)
            config = saved_budgets(config, tag, self.log)  # 'auto' as the run resolved it when it started
        self.parts = build_components(config, rank=self.rank, world_size=self.world_size,
                                      report=self._report, on_reports=self._on_reports, log=self.log,
                                      watchdog=self.watchdog, load=plan)
        self.config = self.parts.config  # (budgets resolved: the checkpoints' run_config.json holds them)
        self._track_sources()
        if plan is not None:
            load_checkpoint(self.parts, config, tag, plan, self.log)
            self.saved = self.resumed = tag  # (saved again only to close a log interval: _end_log_interval)
        self.log("odb: " + ", ".join(f"{k} {v}" for k, v in self.parts.settings.items()))
        # rank 0's tracker runs, from this process's first step on (a resume's: its checkpoint's), told
        # of the rows past it that an earlier process wrote (odb.telemetry.writer)
        telemetry = self.parts.telemetry
        self.parts.trackers.start(telemetry.steps_done, self.log, superseded=telemetry.superseded)
        return self

    def _track_sources(self) -> None:
        """Tells the telemetry the dataset's sources (a mixture's loss per source, over intervals of
        ``--log_steps`` steps, every step with 0: :mod:`odb.telemetry.sources`)."""
        parts = self._built()
        parts.telemetry.set_sources(tuple(parts.dataset.source_names), every=self.config.logging.log_steps or 1)

    # ---- train ------------------------------------------------------------------------------

    def train(self) -> Trainer:
        """The step loop (collective): until the batcher has no more steps, or the run has trained
        ``--max_steps`` steps (counted over the run: a resumed run's steps before its checkpoint count).

        Raises:
            Preempted: SIGTERM or SIGUSR1 reached a rank; every rank stopped after the same step
                and saved a checkpoint (:class:`odb.training.run.stop.GracefulStop`).
        """
        parts, config = self._built(), self.config
        batcher, telemetry, watchdog, stop = parts.batcher, parts.telemetry, self._watched(), self.stop
        assert stop is not None, "call init() first"
        preempted: str | None = None
        if config.logging.audit_ids and parts.writes_data_files:  # (by data-parallel rank: one per SP group)
            self.audit = open(config.output_dir / f"emitted_ids.rank{parts.data_rank}.jsonl", "a")
        progress = self._progress()
        if progress is not None:
            progress.start(telemetry, bar_total=parts.schedule.total)
        telemetry.start()
        max_steps = config.run.max_steps
        if max_steps and telemetry.steps_done >= max_steps:
            self.log(f"odb: the run has trained {telemetry.steps_done} steps, --max_steps {max_steps}: nothing to "
                     "train (raise --max_steps to train on)")
        plans = iter(batcher)
        watchdog.arm()
        while not (max_steps and telemetry.steps_done >= max_steps):  # the same on every rank
            began = time.perf_counter()
            before = batcher.stats
            watchdog.progress("fetching samples and planning", step=telemetry.steps_done, round=before.rounds)
            plan = next(plans, None)  # a round may run here: fetching, planning, one collective
            if plan is None:
                break
            watchdog.progress(f"training ({len(plan.micro_batches)} micro-batches)", step=plan.step)
            samples = [[parts.feed.take(uid) for uid in micro.uids] for micro in plan.micro_batches]
            self._record(plan, parts.engine.train_step(plan, samples, self._lr()), began=began, before=before)
            if progress is not None:
                progress.step(plan, telemetry.last)
            stopping = stop.should_stop(telemetry.steps_done)  # the same step on every rank
            is_last = stopping or bool(max_steps) and telemetry.steps_done >= max_steps
            if config.data.eval_steps and telemetry.steps_done % config.data.eval_steps == 0:
                self.evaluate()
            if is_last:  # before this step's checkpoint: a resume from it starts a new interval
                self._end_log_interval(f"step{telemetry.steps_done}")
            if config.checkpoints.save_steps and telemetry.steps_done % config.checkpoints.save_steps == 0:
                self.save(f"step{telemetry.steps_done}")
            if stopping:
                preempted = f"step{telemetry.steps_done}"
                if self.saved != preempted:
                    self.save(preempted)
                break
        telemetry.stop()
        if progress is not None:
            progress.close()
        if preempted is not None:
            self._gather_totals()  # every rank is here: the last round's steps get their metrics rows
            raise Preempted(telemetry.steps_done, preempted)
        return self

    def _record(self, plan: StepPlan, result: StepResult, *, began: float, before: Any) -> None:
        """Records a trained step: its times (``began``: ``time.perf_counter()`` before its plan was
        drawn; ``before``: the batcher's stats then), the cost fit's forward times, its metrics row
        and its audit line."""
        parts = self._built()
        after = parts.batcher.stats
        times = StepTimes(wait=after.fetch_s - before.fetch_s, plan=after.plan_s - before.plan_s,
                          collective=after.collective_s - before.collective_s, step=time.perf_counter() - began,
                          ended=time.time(), forward=sum(result.forward_seconds))
        parts.batcher.observe(plan, list(result.forward_seconds))  # the cost fit's (cost_model "fit")
        parts.telemetry.record(plan, loss_sum=result.loss_sum, lr=result.lr, times=times, aux_sum=result.aux_sum,
                               source_loss=result.source_loss, source_label_tokens=result.source_label_tokens,
                               source_samples=result.source_samples, rewards=result.rewards)
        self._audit(plan)

    def _watched(self) -> Watchdog:
        assert self.watchdog is not None, "call init() first"
        return self.watchdog

    def _built(self) -> Components:
        assert self.parts is not None, "call build() first"
        return self.parts

    def _lr(self) -> float:
        """The learning rate of the next step, planned over the samples that will train (join
        mode: skipped and dropped records never train); the same on every rank."""
        parts = self._built()
        total = self._planned()
        if parts.batching.mode == "join":
            total = planned_to_train(total, fetched=parts.telemetry.fetched, lost=parts.telemetry.lost)
        return parts.schedule(parts.telemetry.samples_done, total)

    def _planned(self) -> int:
        """Sample visits the run plans: epochs x records, or the quota; a weighted mixture's epoch
        is as long as its current estimate (:meth:`odb.batching.mixture.Mixture.epoch_estimate`)."""
        parts = self._built()
        mixture = parts.batcher.mixture
        if mixture is not None and parts.batching.mode == "join":
            return self.config.run.epochs * mixture.epoch_estimate()
        return parts.schedule.total

    def _report(self) -> np.ndarray:
        """This rank's telemetry vector for the next round (its steps, its whole-run counts)."""
        parts = self._built()
        return parts.telemetry.report(parts.feed.skipped, **self._record_counts())

    def _on_reports(self, reports: np.ndarray) -> None:
        telemetry = self._built().telemetry
        telemetry.on_reports(reports)
        if telemetry.rounds == 1 and not self.config.checkpoints.resume:
            check_first_round(telemetry.skipped, telemetry.fetched)  # every rank has the same figures

    def _progress(self) -> Progress | None:
        """Rank 0's progress display (:mod:`odb.training.run.progress`), None on the other ranks."""
        if self.rank == 0 and self.progress is None:
            self.progress = Progress(planned=self._planned, log_steps=self.config.logging.log_steps)
        return self.progress

    def _record_counts(self) -> dict[str, int]:
        """Records this rank processed over the run (``fetched``), those that will not train
        (``lost``), and those cut to fit (``truncated_samples``, ``truncated_tokens``: by the data
        workers or by the cost model)."""
        parts = self._built()
        stats, workers = parts.batcher.stats, parts.telemetry.truncated_records(parts.feed.truncated)
        return {"fetched": stats.fetched, "lost": stats.lost,
                "truncated_samples": stats.truncated + workers["samples"],
                "truncated_tokens": stats.truncated_tokens + workers["tokens"]}

    def _audit(self, plan: StepPlan) -> None:
        """The step's audit lines: per micro-batch the samples' ``ids`` (a mixture's: each record's
        index within its own source; one source: the dataset index), ``sources`` (their source
        names) and ``epochs`` (each sample's pass over its data)."""
        if self.audit is None:
            return
        dataset = self._built().dataset
        size, names = len(dataset), dataset.source_names
        for m, micro in enumerate(plan.micro_batches):
            located = [dataset.locate(u % size) for u in micro.uids]
            ids = [record for _, record in located]  # (one source: the dataset index itself)
            # each sample's own epoch: in quota mode a step may mix passes over the data
            self.audit.write(json.dumps({"epoch": plan.epoch, "step": plan.step, "micro": m, "ids": ids,
                                         "sources": [names[source] for source, _ in located],
                                         "epochs": [u // size for u in micro.uids]}) + "\n")
        self.audit.flush()  # a run that fails later still shows what it trained

    def _end_log_interval(self, tag: str) -> bool:
        """The run's last per-source log interval ends at this step (the run's end, a stop,
        ``--max_steps``: :meth:`odb.telemetry.Telemetry.end_interval`). Returns whether checkpoint
        ``tag``, this step's, holds that interval open (saved, or resumed into the run's end): it must
        be saved again, or a resume from it would add the interval's steps to a second row."""
        stale = self._built().telemetry.end_interval() and tag in (self.saved, self.resumed)
        if stale:
            self.saved = None
        return stale

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, tag: str) -> None:
        """A checkpoint named ``tag`` (collective)."""
        self._watched().progress(f"saving checkpoint {tag}")
        save_checkpoint(self._built(), self.config, tag)
        self.saved = tag

    # ---- evaluation -------------------------------------------------------------------------

    def evaluate(self) -> None:
        """The exact validation loss over every validation sample (collective), logged and
        written to ``metrics.jsonl`` (W&B) after the step it follows."""
        parts = self._built()
        assert parts.evaluator is not None, "no validation data"
        self._watched().progress("evaluating")
        result = parts.evaluator.run()
        telemetry = parts.telemetry
        telemetry.record_eval(telemetry.steps_done - 1, loss=result.loss, label_tokens=result.label_tokens,
                              samples=result.samples, seconds=result.seconds, over_cap=result.over_cap,
                              sources=result.sources, rewards=result.rewards)
        self.evaluated_at = telemetry.steps_done
        skipped = f", skipped {result.skipped}" if result.skipped else ""
        whole = f", {result.over_cap} over max_tokens scored whole" if result.over_cap else ""
        loss = f"loss {result.loss:.5f}" if result.loss is not None else \
            "no loss (eval_loss null: no sample has a label token; see the skip reasons)"
        by_source = "".join(f"; {name} {'-' if value is None else f'{value:.5f}'} ({tokens} label tokens)"
                            for name, (value, tokens) in result.sources.items())
        self.log(f"eval after step {telemetry.steps_done}: {loss} over {result.samples} samples "
                 f"({result.label_tokens} {result.unit}{whole}, {result.seconds:.1f} s{skipped}){by_source}")

    # ---- the end ----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Collective: the final checkpoint, the one gather of run totals (which also completes the
        last round's metrics), ``summary.json`` (rank 0). Returns the summary."""
        import torch.distributed as dist

        parts, config = self._built(), self.config
        telemetry = parts.telemetry
        self._watched().progress("finishing")
        if parts.evaluator is not None and self.evaluated_at != telemetry.steps_done:
            self.evaluate()
        final = f"step{telemetry.steps_done}"
        stale = self._end_log_interval(final)  # (a --save_steps checkpoint of the last step: saved again)
        if (config.checkpoints.final or stale) and self.saved != final:
            self.save(final)
        if config.checkpoints.save_hf:
            out = config.output_dir / "hf"
            lora = dict(config.model.lora) if config.model.lora is not None else None
            save_hf(parts.engine.backend, model_path=config.model.path, lora=lora, tokenizer=parts.tokenizer, out=out,
                    adapter_only=config.checkpoints.save_adapter_only, vision=parts.dataset.vision)
            self.log(f"saved a Hugging Face model to {out}")
        summary = self._summary()
        if self.rank == 0:
            (config.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            if self.saved == final:
                mark_finished(config, final)  # a resume from it is refused: nothing is left to do
            self.log(f"done: {json.dumps(summary)}")
            parts.trackers.record_summary(summary)
        self._watched().stop()  # peers leave after the barrier (rank 0 takes the store with it)
        dist.barrier()
        return summary

    def _summary(self) -> dict[str, Any]:
        """The one gather of run totals (collective) and the run's summary (``summary.json``'s)."""
        parts, config = self._built(), self.config
        telemetry, batcher = parts.telemetry, parts.batcher
        totals = self._gather_totals()
        if parts.feed.examples:
            print(f"rank {self.rank} skipped records, e.g.: " + "; ".join(parts.feed.examples), flush=True)
        summary = telemetry.summary(totals, world_size=parts.data_world,  # (the totals' rows: data-parallel ranks)
                                    epochs=config.run.epochs if parts.batching.mode == "join" else None,
                                    rounds=batcher.stats.rounds,
                                    collectives=parts.comm.num_collectives - (parts.preflight.collectives
                                                                              if parts.preflight else 0),
                                    policy=parts.batching.policy)
        summary["world_size"], summary["sequence_parallel_size"] = self.world_size, self.world_size // parts.data_world
        summary["this_process"]["peak_memory_mb"] = peak_memory_mb()
        summary["preflight"] = parts.preflight.to_dict() if parts.preflight is not None else None
        fitted = batcher.cost_fit  # (cost_model "fit": None until the first fit)
        summary["cost_model"] = {"mode": parts.batching.cost_model, "attn_coef": batcher.cost_model.attn_coef,
                                 "patch_coef": batcher.cost_model.patch_coef, "a2a_coef": batcher.cost_model.a2a_coef,
                                 "fit_r2": fitted.r2 if fitted else None,
                                 "fit_micro_batches": fitted.observations if fitted else None}
        summary["config"] = config.to_dict()
        return summary

    def _gather_totals(self) -> dict[str, int]:
        """The one gather of run totals (collective), which also completes the last round's metrics."""
        parts = self._built()
        vector = parts.telemetry.final_report(parts.feed.skipped, **self._record_counts(),
                                              dropped=parts.batcher.stats.dropped)
        return parts.telemetry.on_final_reports(parts.batcher.gather_reports(vector))

    def shutdown(self, error: BaseException | None = None) -> None:
        """Local and safe after any error (``error``: what stopped the run, if anything): writes the
        metrics rows that a failed round's gather completes, closes the files, stops the DataLoader
        workers, ends the tracker runs (marked failed on error, preempted on a stop on request),
        leaves the process group and removes DeepSpeed's shared memory. A step that fails is
        reported and the rest still run."""
        parts = self.parts
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self.watchdog is not None:  # first: peers waiting on this rank hear of the error now
            watchdog = self.watchdog
            steps.append(("stopping the watchdog", lambda: watchdog.stop(error)))
        if parts is not None and error is not None:  # the failed round's gather completes the steps it reported
            reports = parts.batcher.last_reports
            steps.append(("completing the failed round's metrics", lambda: parts.telemetry.complete_gathered(reports)))
        if parts is not None:
            steps.append(("closing metrics.jsonl", parts.telemetry.close))
        if self.audit is not None:
            steps.append(("closing the audit file", self.audit.close))
        if parts is not None:
            steps.append(("stopping the DataLoader workers", parts.feed.close))
        preempted = isinstance(error, Preempted)
        code = 0 if error is None else EXIT_PREEMPTED if preempted else 1
        for tracker in parts.trackers if parts is not None else ():
            steps.append((f"finishing the {tracker.title} run", lambda t=tracker: t.finish(code, preempted=preempted)))
        steps.append(("leaving the process group", leave_process_group))
        steps.append(("the backend's clean-up", backends.get(self.config.optimization.backend).release))
        for what, step in steps:
            try:
                step()
            except Exception as err:  # noqa: BLE001 - the next steps must still run
                print(f"rank {self.rank}: shutdown: {what} failed: {type(err).__name__}: {err}",
                      file=sys.stderr, flush=True)

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)
