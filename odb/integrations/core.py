"""odb's side of a run whose loop is a host's own (HF ``Trainer``, TRL, an Accelerate loop).

The host keeps what it owns: the model's wrapping (DeepSpeed, FSDP, DDP), the optimizer and its
step, the backward, checkpoints of the model, logging. odb keeps what it owns, built by the same
code as odb's own trainer (:func:`odb.training.run.assemble.build_components`): the data (processed in
DataLoader workers), the online batcher and its alignment of the ranks, the loss of each packed
micro-batch (:class:`odb.training.step.objective.NextTokenTally`), the learning rate by progress, metrics.jsonl,
the audit files and summary.json. Per optimizer step the host runs :class:`HostStep`'s
micro-batches, every one of them (dummies are real zero-weight passes), backs each
:meth:`HostMicro.loss` (already scaled for the step: ``sum_t l_t * W / N_s``, or under a preference
objective ``sum_p loss_p * W / P_s``, the step's pairs over every rank; the host must not divide it
by the accumulation steps nor average it again), reduces the gradients over the ranks in
the last micro-batch's backward only, steps the optimizer at :attr:`HostStep.lr`, then calls
:meth:`HostStep.end`. So I1-I6 hold in the host's loop as in odb's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from odb.batching.config import AUTO, OdbConfig
from odb.batching.mixture import epoch_records
from odb.batching.plan import MicroBatch, StepPlan
from odb.batching.state import upgrade_state
from odb.training import backends
from odb.training.config.objective import ObjectiveSettings
from odb.training.config.optimization import BACKENDS, Fsdp2Settings, OptimizationSettings
from odb.training.config.settings import (
    DataSettings,
    LoggingSettings,
    ModelSettings,
    PreflightSettings,
    RunConfig,
    RunSettings,
)
from odb.training.run.assemble import build_components
from odb.training.run.checkpoint import checkpoint_states, restore_states, write_states
from odb.training.run.datasets import PROBE_RECORDS, mean_units
from odb.training.run.loop import Trainer
from odb.training.run.schedule import ProgressSchedule

__all__ = ["HostMicro", "HostModel", "HostRun", "HostStep", "OdbSettings", "host_config"]


class HostModel:
    """The host's model as odb's engine calls it (:class:`odb.training.backends.Backend`'s forward
    part): ``module`` the model itself (PEFT's too), :attr:`call` what the host wraps it in (a
    DeepSpeed engine, DDP, FSDP), through which each forward runs."""

    name = "host"

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device
        self.call: Any = module

    def __call__(self, **batch: Any) -> Any:
        return self.call(**batch)


@dataclass(frozen=True, kw_only=True)
class OdbSettings:
    """What odb needs from a host's run besides the host's own arguments (the learning rate, the
    accumulation steps, epochs, the output folder, DeepSpeed's or FSDP's settings)."""

    data: DataSettings
    """The training data and how records become samples (odb's, as ``--data``, ``--data_config``)."""
    batching: OdbConfig
    """odb's batching (``max_tokens``, ...); its ``gas`` is the host's gradient accumulation steps
    (left at 1, it takes the host's)."""
    tokenizer: str | None = None
    """The tokenizer folder; None: the model's folder (a model built from a config has none: set it)."""
    audit_ids: bool = False
    """Write emitted_ids.rank<R>.jsonl (every micro-batch's record indices and sources), as odb's trainer."""
    log_steps: int = 0
    """Rank 0 prints odb's line every N steps (0: the host's logging only)."""


def host_config(settings: OdbSettings, *, model_path: str, output_dir: str | Path, lr: float, warmup_ratio: float,
                weight_decay: float, epochs: int, gas: int, backend: str = "deepspeed",
                backend_settings: Mapping[str, Any] | Fsdp2Settings | None = None,
                objective: ObjectiveSettings | None = None, lora: Mapping[str, Any] | None = None) -> RunConfig:
    """The :class:`RunConfig` of a host's run: odb's settings with the host's values where the host
    owns them. ``backend``: what the host wraps the model in, 'deepspeed' (also DDP: ZeRO-0) or
    'fsdp2', with ``backend_settings`` (DeepSpeed's resolved config, :class:`Fsdp2Settings`;
    None: empty, the defaults). ``objective``: what the host's trainer trains (None: next-token
    loss; a preference objective reads every record as a pair); ``lora``: the LoRA settings of the
    adapter the host trains (None: every weight), which a preference reference ``adapter`` needs.
    A gas in ``settings.batching`` other than 1 must be the host's;
    ``max_tokens`` must be a number (the preflight that measures 'auto' runs odb's own steps)."""
    batching = settings.batching
    if batching.gas not in (1, gas):
        raise ValueError(f"odb's gas {batching.gas} differs from the host's gradient_accumulation_steps {gas}: they "
                         "are one setting; set gradient_accumulation_steps and leave odb's gas out")
    if batching.global_batch_tokens is not None:
        raise ValueError("global_batch_tokens derives odb's gas, and the host owns gradient_accumulation_steps: "
                         "set that instead (tokens per step = ranks x gradient_accumulation_steps x about "
                         "min_fill x max_tokens)")
    if AUTO in (batching.max_tokens, batching.max_patches):
        raise ValueError("max_tokens / max_patches 'auto' is measured by odb's preflight, which runs only in odb's own "
                         "trainer (launch/train.py): set a number (run the preflight there once to find it)")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if settings.data.has_eval:
        raise ValueError("OdbSettings.data: eval_path / val_ratio is odb's own evaluation, which runs in odb's "
                         "trainer only (val_ratio would hold samples out of training for nothing); evaluate with "
                         "the host's eval_dataset")
    if settings.data.streaming:
        raise ValueError("OdbSettings.data: a streaming source's records are counted only as they are read, and "
                         "the host needs its step count up front; train a streaming source with odb's trainer "
                         "(odb train / launch/train.py --streaming), or drop streaming to index the data")
    if settings.tokenizer is None and model_path == "host model":  # (the adapters' name for a model without a path)
        raise ValueError("the model has no folder (its config's _name_or_path is empty: built from a config) to read "
                         "a tokenizer from: set OdbSettings(tokenizer=FOLDER), the tokenizer to tokenize the data with")
    empty = {"deepspeed": {}, "fsdp2": Fsdp2Settings()}  # (OptimizationSettings' field of each)
    tokenizer = settings.tokenizer or model_path
    return RunConfig(
        model=ModelSettings(path=model_path, tokenizer=tokenizer, lora=lora),
        data=settings.data,
        batching=dataclasses.replace(batching, gas=gas),
        optimization=OptimizationSettings(lr=lr, warmup_ratio=warmup_ratio, weight_decay=weight_decay,
                                          backend=backend, **{backend: backend_settings or empty[backend]}),
        run=RunSettings(output_dir=str(output_dir), epochs=epochs),
        logging=LoggingSettings(audit_ids=settings.audit_ids, log_steps=settings.log_steps),
        preflight=PreflightSettings(preflight="off"), objective=objective or ObjectiveSettings())


@dataclass(eq=False)
class HostMicro:
    """One micro-batch of a :class:`HostStep`: its samples, processed, and how odb packs them."""

    step: HostStep
    index: int
    micro: MicroBatch
    samples: Sequence[dict[str, Any]]

    @property
    def is_dummy(self) -> bool:
        """A zero-weight pass (this rank has nothing left at this position): run it all the same."""
        return self.micro.is_dummy

    @property
    def is_last(self) -> bool:
        """The step's last micro-batch: its backward reduces the gradients over the ranks."""
        return self.index == len(self.step.micro_batches) - 1

    @property
    def tokens(self) -> int:
        return self.micro.tokens

    def loss(self) -> torch.Tensor:
        """The forward (through the host's model) and the loss to back: ``sum_t l_t * W / N_s``,
        a router loss's share for a mixture of experts (a preference objective: the reference's
        forward first, then ``sum_p loss_p * W / P_s``), 0 x a real forward for a dummy."""
        return self.step.tally.loss(self.micro, self.samples)


class HostStep:
    """One optimizer step of the plan: every rank has as many micro-batches (I1)."""

    def __init__(self, run: HostRun, plan: StepPlan, samples: list[list[dict[str, Any]]], lr: float,
                 began: float, before: Any) -> None:
        self.run, self.plan, self.lr = run, plan, lr
        self.tally = run.parts.engine.tally(plan)
        self.micro_batches = [HostMicro(self, m, micro, s) for m, (micro, s) in
                              enumerate(zip(plan.micro_batches, samples, strict=True))]
        self._began, self._before = began, before
        self.ended = False

    @property
    def num_label_tokens(self) -> int:
        """``N_s``: the step's label tokens over every rank (the host's ``num_items_in_batch``)."""
        return self.plan.num_label_tokens

    def end(self) -> None:
        """The host has run every micro-batch and stepped the optimizer: odb records the step
        (metrics.jsonl, the audit file, the cost fit's times)."""
        if self.ended:
            return
        self.run._record(self.plan, self.tally.result(self.lr), began=self._began, before=self._before)
        self.ended = True


class HostRun(Trainer):
    """odb's side of one rank of a host's run (collective where odb's trainer is: building,
    every step's plan, :meth:`finish`). The process group is the host's, joined already.

    Args:
        config: :func:`host_config`'s.
        model: the host's model, as built (not yet wrapped: :attr:`HostModel.call` is set to the
            wrapped one before the first forward).
        device: where the host runs it.
        schedule: the learning rate by progress (default: odb's, from ``config``).
        reference: a preference objective's separate reference model (reference ``model``:
            TRL's ``ref_model``), its :attr:`HostModel.call` what the host wrapped it in.
    """

    def __init__(self, config: RunConfig, model: torch.nn.Module, *, device: torch.device,
                 schedule: ProgressSchedule | None = None, resuming: bool = False,
                 reference: HostModel | None = None) -> None:
        import torch.distributed as dist

        self._own_group = _one_rank_group()
        super().__init__(config, rank=dist.get_rank(), world_size=dist.get_world_size())
        found = [p.name for p in sorted(config.output_dir.glob("*")) if p.name in ("metrics.jsonl", "summary.json")
                 or p.name.startswith("emitted_ids.rank")]
        if found and not resuming:
            raise ValueError(f"{config.output_dir} holds an earlier run's {', '.join(found)}: resume it, or remove "
                             "them, or pass another output folder (odb appends to its files)")
        self.host = HostModel(model, device)
        config.output_dir.mkdir(parents=True, exist_ok=True)
        self.parts = build_components(config, rank=self.rank, world_size=self.world_size, report=self._report,
                                      on_reports=self._on_reports, log=self.log, backend=self.host,
                                      reference=reference)
        if schedule is not None:
            self.parts = dataclasses.replace(self.parts, schedule=schedule)
        self._track_sources()  # (a mixture's loss per source, as odb's trainer writes it)
        self.current: HostStep | None = None
        self._stepping = False

    @property
    def planned_samples(self) -> int:
        """The samples the run plans to train (epochs x records, or the quota; a weighted mixture's
        epoch: its records, until :meth:`step_bound`)."""
        return self._built().schedule.total

    def step_bound(self) -> int:
        """Collective (every rank, before the first step): the most optimizer steps the run takes, for
        a host that fixes its step count first (HF Trainer's ``max_steps``); the same on every rank.

        Each step trains at least one sample, so it is the samples the run plans: epochs x records,
        or the quota, as is also a weighted mixture's with ``mix_epoch: first`` (every record at most
        once an epoch). With ``"all"`` a mixture up-samples the sources that reach their share first,
        by how much is known only as their units are measured: the bound is then an estimate, twice
        the records :func:`odb.batching.mixture.epoch_records` gives for each source's mean units in
        a seeded probe of :data:`odb.training.run.datasets.PROBE_RECORDS` of its records. Should the
        host reach it before the data ends, it stops there, every rank at the same step (the host's
        caller says what was left: :meth:`untrained`)."""
        parts, data = self._built(), self.config.data
        bound = self.planned_samples
        if parts.batcher.mixture is not None and parts.batching.mode == "join" and data.mix_epoch == "all":
            means = mean_units(parts.dataset, parts.batcher.cost_model, data.mix_by, seed=self.config.seed)
            weights = [s.weight for s in data.sources]
            epoch = sum(epoch_records(parts.dataset.sizes, weights, means, epoch_rule="all"))
            bound = self.config.run.epochs * 2 * epoch
            self.log(f"odb: a weighted mixture's epoch up-samples as its units are measured: about {epoch} records "
                     f"(each source's mean {data.mix_by} a record in {PROBE_RECORDS} of its records: "
                     f"{', '.join(f'{m:.1f}' for m in means)}); the host's step bound: {bound}, twice that x "
                     f"{self.config.run.epochs} epoch(s)")
        return parts.batcher.aligner.largest(bound)

    def untrained(self) -> str | None:
        """What of the planned data the run has not trained, where its steps stopped before the data
        ended (None: it ended, or no step ran)."""
        parts = self._built()
        if parts.batcher.is_done or not parts.telemetry.steps_done:
            return None
        return (f"{parts.telemetry.samples_done} samples trained in {parts.telemetry.steps_done} steps, epoch "
                f"{parts.batcher.epoch + 1} of {self.config.run.epochs} not over")

    def lr(self) -> float:
        """The learning rate of the next step (odb's schedule by progress), the same on every rank."""
        return self._lr()

    def steps(self) -> Iterator[HostStep]:
        """The run's steps in order, until the batcher has no more (collective: a round may run at
        each). End each with :meth:`HostStep.end` before asking for the next."""
        parts = self._built()
        if self._stepping:
            raise RuntimeError("odb's steps are one stream per run: iterate steps() once (a host's second epoch "
                               "gets nothing; odb's epochs are in the one stream)")
        self._stepping = True
        batcher, telemetry = parts.batcher, parts.telemetry
        if self.config.logging.audit_ids and self.audit is None:
            self.audit = open(self.config.output_dir / f"emitted_ids.rank{self.rank}.jsonl", "a")
        progress = self._progress()
        if progress is not None:
            progress.start(telemetry)  # (no bar: the host shows its own; the lines every --log_steps steps)
        telemetry.start()
        plans = iter(batcher)
        try:
            while True:
                began, before = time.perf_counter(), batcher.stats
                plan = next(plans, None)  # a round may run here: fetching, planning, one collective
                if plan is None:
                    break
                samples = [[parts.feed.take(uid) for uid in micro.uids] for micro in plan.micro_batches]
                self.current = HostStep(self, plan, samples, self._lr(), began, before)
                yield self.current
                if not self.current.ended:
                    raise RuntimeError(f"step {plan.step} was not ended: call step.end() after the optimizer step, "
                                       "before the next step")
        finally:  # (also where the host stopped early: max_steps, a break)
            telemetry.stop()

    # ---- checkpoints: odb's files in the host's checkpoint folder ---------------------------------

    def save_states(self, folder: str | Path) -> None:
        """This rank's odb files into the host's checkpoint ``folder`` (after the step it follows
        has ended)."""
        write_states(self._built(), Path(folder))

    def load_states(self, folder: str | Path) -> None:
        """Continues from :meth:`save_states`'s files in ``folder`` (also those of another number of
        ranks, re-dealt to this one); before the first step."""
        folder = Path(folder)
        if not (folder / "odb_state.rank0.json").is_file():
            raise FileNotFoundError(f"{folder} holds no odb state (odb_state.rank0.json): it was not saved by a run "
                                    "with odb switched on; resume from one that was, or start over")
        state, run_state, saved = checkpoint_states(folder, rank=self.rank, world_size=self.world_size)
        restore_states(self._built(), upgrade_state(state), run_state)
        moved = f", saved by {saved} ranks" if saved != self.world_size else ""
        self.log(f"odb: resumed from {folder}: {self._built().telemetry.samples_done} samples done{moved}")

    # ---- the end --------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Collective: the one gather of run totals and ``summary.json`` (rank 0), as odb's trainer
        writes it. Returns the summary."""
        import json

        import torch.distributed as dist

        self._built().telemetry.stop()  # the train loop's time ends here if the host stopped it early
        summary = self._summary()
        if self.rank == 0:
            (self.config.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        dist.barrier()
        return summary

    def close(self, error: BaseException | None = None) -> None:
        """Local, safe after any error: metrics.jsonl, the audit file, the DataLoader workers, and
        DeepSpeed's shared-memory buffer of a CPU rank, which DeepSpeed never removes
        (:func:`odb.training.backends.deepspeed.release`). The process group stays the host's."""
        parts = self.parts
        if parts is not None and error is not None:
            parts.telemetry.complete_gathered(parts.batcher.last_reports)
        release = backends.get(self.config.optimization.backend).release
        for what, close in (("metrics.jsonl", parts.telemetry.close if parts else None),
                            ("the audit file", self.audit.close if self.audit else None),
                            ("the DataLoader workers", parts.feed.close if parts else None),
                            ("DeepSpeed's shared memory", release)):
            if close is None:
                continue
            try:
                close()
            except Exception as err:  # noqa: BLE001 - the rest must still close
                self.log(f"odb: closing {what} failed: {type(err).__name__}: {err}")
        if self._own_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._own_group = False


def _one_rank_group() -> bool:
    """Joins a one-rank process group where the host runs as a single process without one (HF
    Trainer and Accelerate join none then), so that odb's collectives run alike; True if it did.
    Several processes without a group are an error naming the fix."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise RuntimeError(f"WORLD_SIZE {os.environ['WORLD_SIZE']} but no process group: create the host's trainer "
                           "(or Accelerator) first, which joins it")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True
