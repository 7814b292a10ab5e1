"""What :func:`odb.integrations.hf.with_odb` adds to a Hugging Face ``Trainer`` class
(:class:`OdbTrainerMixin`), and how the host's arguments map onto odb's (:func:`check_arguments`,
:func:`schedule`); :mod:`odb.integrations.hf`'s docstring says what each argument means under odb."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from odb.integrations.core import HostModel, HostRun, OdbSettings, host_config
from odb.training.attention.varlen import register
from odb.training.run.schedule import ProgressSchedule

__all__ = ["SCHEDULES", "OdbTrainerMixin", "check_arguments", "schedule"]

SCHEDULES = {"linear": ("linear", 0.0), "cosine": ("cosine", 0.0), "cosine_with_min_lr": ("cosine", None),
             "constant": ("constant", 1.0), "constant_with_warmup": ("constant", 1.0)}
"""The host's ``lr_scheduler_type`` -> odb's decay by progress and its floor (None: the host's
``min_lr_rate``)."""


def _value(choice) -> str:
    """An argument's choice as its string (TrainingArguments holds enums)."""
    return getattr(choice, "value", choice)


def _scheduler_type(args) -> str:
    return _value(args.lr_scheduler_type)


def schedule(args, planned: int) -> ProgressSchedule:
    """The host's ``learning_rate``, ``lr_scheduler_type`` and ``warmup_steps`` (a ratio) over the
    ``planned`` samples, as odb's schedule by progress."""
    decay, floor = SCHEDULES[_scheduler_type(args)]
    if floor is None:  # cosine_with_min_lr: min_lr_rate, or min_lr (absolute)
        kwargs = args.lr_scheduler_kwargs or {}
        floor = kwargs["min_lr"] / args.learning_rate if "min_lr" in kwargs and args.learning_rate else \
            kwargs.get("min_lr_rate", 0.0)
    warmup = 0.0 if _scheduler_type(args) == "constant" else float(args.warmup_steps)  # (HF's constant: none)
    return ProgressSchedule(args.learning_rate, planned, warmup_ratio=warmup, min_ratio=floor, decay=decay)


def check_arguments(args, odb: OdbSettings, *, next_token: bool = True) -> None:
    """Raises ``ValueError`` naming odb's setting where a host argument cannot keep its meaning
    (``next_token``: the host trains next-token loss, whose TRL ``loss_type`` is SFT's; a
    preference trainer's own fields are :func:`odb.integrations.dpo.preference_objective`'s)."""
    if args.per_device_train_batch_size not in (1, 8):  # (8: TrainingArguments' default, left as is)
        raise ValueError(f"per_device_train_batch_size={args.per_device_train_batch_size}: under odb a micro-batch is "
                         "one packed row of at most max_tokens tokens; set OdbSettings.batching.max_tokens and leave "
                         "per_device_train_batch_size at 1")
    if _scheduler_type(args) not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={_scheduler_type(args)!r}: odb's schedule follows the samples trained, "
                         f"in one of the shapes {sorted(SCHEDULES)}")
    if args.warmup_steps >= 1:
        raise ValueError(f"warmup_steps={args.warmup_steps}: odb warms up over a share of the planned samples (its "
                         "step count is known only as samples pack); pass warmup_steps as a ratio < 1")
    if args.num_train_epochs != int(args.num_train_epochs) or args.num_train_epochs < 1:
        raise ValueError(f"num_train_epochs={args.num_train_epochs}: odb trains whole epochs; pass a whole number, or "
                         "max_steps to stop earlier")
    ratios = [f"{name}={getattr(args, name)}" for name in ("save_steps", "eval_steps", "logging_steps")
              if getattr(args, name) is not None and 0 < getattr(args, name) < 1]
    if ratios:
        raise ValueError(f"{', '.join(ratios)}: a ratio of the host's step count, which odb knows only as samples "
                         "pack; pass whole steps")
    changed = [f"{name}={value!r}" for name, value, default in (
        ("label_smoothing_factor", args.label_smoothing_factor, 0.0),
        ("loss_type", getattr(args, "loss_type", "nll") if next_token else "nll", "nll"))  # (TRL's SFTConfig)
        if value != default]
    if changed:
        loss = ("next-token cross entropy summed over the step's label tokens (odb.training.step.objective)"
                if next_token else "the preference loss of each pair (odb.training.step.preference)")
        fix = "label_smoothing_factor=0 and loss_type='nll'" if next_token else "label_smoothing_factor=0"
        raise ValueError(f"{', '.join(changed)}: odb backs its own loss for every micro-batch, {loss}, so this would "
                         f"be dropped; set {fix}")
    if args.auto_find_batch_size:
        raise ValueError("auto_find_batch_size: odb's budget is max_tokens (measure it once with launch/train.py's "
                         "preflight, max_tokens auto); turn auto_find_batch_size off")
    if args.deepspeed and "scheduler" in (args.hf_deepspeed_config.config or {}):
        raise ValueError("the DeepSpeed config's \"scheduler\": the learning rate is odb's schedule by progress "
                         "(lr_scheduler_type, warmup_steps); drop the scheduler section")
    if odb.batching.gas not in (1, args.gradient_accumulation_steps):
        raise ValueError(f"OdbSettings.batching.gas {odb.batching.gas} and gradient_accumulation_steps "
                         f"{args.gradient_accumulation_steps} are one setting: set gradient_accumulation_steps only")


class _Steps:
    """The host's train dataloader: odb's step stream (no length; see :class:`OdbTrainer`)."""

    def __init__(self, run: HostRun) -> None:
        self.run = run

    def __iter__(self):
        return self.run.steps()


class OdbTrainerMixin:
    """What :func:`with_odb` adds to a ``Trainer`` class (module docstring)."""

    loss_is_scaled_for_ga = True  # odb's micro-batch loss is scaled for the whole step already
    odb_next_token = True  # the host trains next-token loss (a preference trainer: odb.integrations.dpo)

    def _host_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The host trainer's ``__init__`` arguments by name (the class this mixin is mixed into,
        or a user's subclass of it), ``self`` left out: what a preference mixin checks before the
        host's own start."""
        mro = type(self).__mro__
        host = mro[mro.index(OdbTrainerMixin) + 1]
        bound = inspect.signature(host.__init__).bind(self, *args, **kwargs).arguments
        bound.pop(next(iter(bound)))  # (self)
        return bound

    def __init__(self, *args: Any, odb: OdbSettings, **kwargs: Any) -> None:
        if kwargs.get("train_dataset") is not None:
            raise ValueError("the training data is odb's (OdbSettings.data): drop train_dataset, odb reads, processes "
                             "and packs the records itself")
        host_args = kwargs.get("args")
        if host_args is not None and hasattr(host_args, "dataset_kwargs"):  # TRL: nothing of its own to prepare
            host_args.dataset_kwargs = {**(host_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        from datasets import Dataset

        # a stand-in for trainers that require a dataset and look at its first record (TRL): never read
        kwargs["train_dataset"] = Dataset.from_dict({"text": ["odb reads, processes and packs the data itself"]})
        super().__init__(*args, **kwargs)
        check_arguments(self.args, odb, next_token=self.odb_next_token)
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError("compute_loss_func: odb backs its own loss for every micro-batch (sum of token losses x "
                             "W / N_step, odb.training.step.objective), so this function would never run; drop "
                             "compute_loss_func (another loss: an objective in odb/training/step/objective.py)")
        if getattr(self.args, "packing", False):  # TRL's own packing
            raise ValueError("packing=True is TRL's packing of a dataset; odb packs online: leave packing off")
        if self.optimizer is not None and self.lr_scheduler is not None:
            raise ValueError("optimizers=(optimizer, scheduler): the learning rate is odb's schedule by progress; "
                             "pass optimizers=(optimizer, None)")
        self.odb_settings = odb
        self.odb_run: HostRun | None = None
        self._odb_saved: int | None = None  # the step of the last checkpoint
        self._odb_bound: int | None = None  # the max_steps odb gave the host (None: the host's own)
        self._odb_parameters: int | None = None  # the model's, without embeddings (floating_point_ops)
        self.args.ignore_data_skip = True  # odb restores its own position; nothing to replay
        self.model.set_attn_implementation(register())  # packed rows: each sample attends to itself only
        self.add_callback(_OdbCallback(self))

    # ---- odb's run --------------------------------------------------------------------------

    def _odb_config(self):
        args, model = self.args, self.model
        backend, settings = ("fsdp2", None) if self.is_fsdp_enabled else \
            ("deepspeed", args.hf_deepspeed_config.config if args.deepspeed else None)
        return host_config(self.odb_settings, model_path=_model_path(model), output_dir=args.output_dir,
                           lr=args.learning_rate, warmup_ratio=float(args.warmup_steps),
                           weight_decay=args.weight_decay, epochs=int(args.num_train_epochs),
                           gas=args.gradient_accumulation_steps, backend=backend, backend_settings=settings,
                           **self._odb_objective())

    def _odb_objective(self) -> dict[str, Any]:
        """:func:`host_config`'s ``objective`` and ``lora`` where the host trains another objective
        than next-token loss (:class:`odb.integrations.dpo.OdbDPOMixin`)."""
        return {}

    def _odb_reference(self) -> HostModel | None:
        """A preference objective's separate reference model, as the host wraps it (None: none)."""
        return None

    def _odb_build(self) -> HostRun:
        if self.odb_run is None:
            resume = getattr(self, "_odb_resume", None)
            run = HostRun(self._odb_config(), self.model, device=self.args.device, resuming=bool(resume),
                          reference=self._odb_reference())
            run.parts = dataclasses.replace(run.parts, schedule=schedule(self.args, run.planned_samples))
            self.odb_run = run
            if resume:
                run.load_states(resume)
        return self.odb_run

    def get_train_dataloader(self):
        run = self._odb_build()
        if self.args.max_steps <= 0:  # the host needs a step count up front: odb's bound (collective)
            self.args.max_steps = self._odb_bound = run.step_bound()
        return _Steps(run)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """One odb step: its micro-batches (every rank as many) and ``N_s``."""
        step = next(epoch_iterator, None)
        if step is None:  # the stream has ended: every epoch is trained; the end's log, evaluation, save
            self._odb_end()
            return [], None
        if len(step.micro_batches) != num_batches:
            raise RuntimeError(f"odb planned {len(step.micro_batches)} micro-batches for a step of {num_batches}: "
                               "gradient_accumulation_steps changed after the trainer was built")
        peak = self.args.learning_rate
        for group in self.optimizer.param_groups:  # odb's rate for this step, as odb's trainer sets it
            group["lr"] = step.lr * group.get("initial_lr", peak) / peak if peak else step.lr
        return [{"odb": micro} for micro in step.micro_batches], torch.tensor(step.num_label_tokens, device=device)

    def _odb_end(self) -> None:
        """What HF does when its last step is done (``global_step >= max_steps``), for odb's last
        step: the step count becomes the real one, and the epoch's end (which follows) logs,
        evaluates and saves as the strategies ask, unless this step was saved already."""
        args, state, control = self.args, self.state, self.control
        state.max_steps = state.global_step
        control.should_training_stop = True
        control.should_log = True
        control.should_evaluate = _value(args.eval_strategy) != "no"
        control.should_save = _value(args.save_strategy) != "no" and self._odb_saved != state.global_step

    def _save_checkpoint(self, model, trial):
        """odb's state first, then the host's checkpoint: a folder the host has written holds odb's
        files (a resume picks the newest ``checkpoint-N``)."""
        self.odb_run.save_states(Path(self._get_output_dir(trial=trial)) /
                                 f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._odb_saved = self.state.global_step
        return super()._save_checkpoint(model, trial)

    def _get_learning_rate(self):
        """The rate the step that just ended ran at (odb's), for the host's log."""
        run = self.odb_run
        return run.current.lr if run is not None and run.current is not None else super()._get_learning_rate()

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if "odb" not in inputs:  # the host's own batches (evaluation): the host's own loss, padded rows
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        micro = inputs["odb"]
        self.odb_run.host.call = model  # through the host's wrapping (DeepSpeed, DDP, FSDP)
        loss = micro.loss()
        return (loss, None) if return_outputs else loss

    def floating_point_ops(self, inputs) -> int:
        if "odb" not in inputs:
            return super().floating_point_ops(inputs)
        if self._odb_parameters is None:  # (counted once: it walks every parameter)
            self._odb_parameters = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs["odb"].tokens * self._odb_parameters

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """odb's learning rate by progress: a ``LambdaLR`` that reads it (each step also sets it
        when its plan is drawn, :meth:`get_batch_samples`)."""
        if self.lr_scheduler is None:
            peak = self.args.learning_rate
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, lambda _: self._odb_build().lr() / peak if peak else 1.0)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if self.odb_run is not None:
            raise RuntimeError("odb's run is one stream of steps: train() once per trainer (build a new trainer "
                               "to resume, with train(resume_from_checkpoint=...))")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True: no checkpoint-N folder in {self.args.output_dir}")
        self._odb_resume = resume_from_checkpoint or None
        try:
            result = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            left = self._odb_build().untrained() if self._odb_bound else None
            if left is not None:  # (the bound was odb's estimate, and the data ran past it)
                self.odb_run.log(f"odb: WARNING: the host stopped at max_steps {self._odb_bound}, odb's estimate of "
                                 f"the run's steps, before the data ended ({left}): resume with a larger max_steps, "
                                 "or set max_steps yourself")
            self.odb_summary = self._odb_build().finish()
        except BaseException as error:
            if self.odb_run is not None:
                self.odb_run.close(error)
            raise
        self.odb_run.close()
        return result


def _model_path(model) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return path or "host model"


class _OdbCallback(TrainerCallback):
    """Ends odb's step after the host's optimizer step (before the host logs or saves it)."""

    def __init__(self, trainer: OdbTrainerMixin) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        run = self.trainer.odb_run
        if run is not None and run.current is not None:
            run.current.end()
