"""odb inside Hugging Face ``Trainer`` and TRL's trainers: :class:`OdbTrainer`, or
:func:`with_odb` on any ``Trainer`` subclass (``with_odb(SFTTrainer)``, ``with_odb(DPOTrainer)``,
``with_odb(RewardTrainer)``).

    trainer = OdbTrainer(model=model, args=TrainingArguments(..., deepspeed="configs/ds_zero2.json"),
                         odb=OdbSettings(data=DataSettings(path="data/chat.jsonl"),
                                         batching=OdbConfig(max_tokens=8192)))
    trainer.train()                           # or train(resume_from_checkpoint=True)

What the host's arguments mean under odb (each kept, or refused naming odb's setting):

* ``per_device_train_batch_size``: a micro-batch is one packed row of at most ``max_tokens``
  tokens; leave it at 1 (or the default), any other value is refused.
* ``gradient_accumulation_steps``: odb's ``gas``, micro-batches per optimizer step on every rank.
* ``num_train_epochs``: odb's epochs (a whole number); ``max_steps`` > 0: stop after that many
  optimizer steps. Left unset, ``max_steps`` is odb's bound (:meth:`HostRun.step_bound`): the
  planned samples, an upper bound on the steps (odb knows its step count only as samples pack),
  for a weighted mixture with ``mix_epoch: all`` an estimate (twice a probe's); the run ends when
  the data does, or at the bound, every rank at the same step (odb warns if data was left).
* ``learning_rate``, ``warmup_steps`` (a ratio < 1; whole steps are refused), ``lr_scheduler_type``
  (linear, cosine, cosine_with_min_lr, constant, constant_with_warmup) and ``weight_decay``: the
  schedule follows the samples trained over those planned, as odb's own does.
* ``deepspeed=`` and FSDP: the host's; odb's loss is already scaled for the step, so the host
  neither divides it by the accumulation steps nor rescales it (``num_items_in_batch`` is odb's
  ``N_s``, the step's label tokens over every rank).
* ``label_smoothing_factor``, TRL's ``loss_type`` and ``compute_loss_func``: odb backs its own loss
  (next-token cross entropy over the step's label tokens); anything but their defaults is refused.
  ``with_odb(DPOTrainer)`` backs DPO's instead (sigmoid, IPO, hinge: the mean over the step's
  pairs on every rank), its DPOConfig mapped or refused field by field (:mod:`odb.integrations.dpo`);
  ``with_odb(RewardTrainer)`` a reward model's (``-log sigmoid(r_c - r_r)``, TRL's centering term
  too: the mean over the step's pairs), its RewardConfig likewise (:mod:`odb.integrations.reward`).
* checkpoints: each ``checkpoint-N`` folder also holds odb's state; ``resume_from_checkpoint``
  restores odb's position exactly (``ignore_data_skip`` is set: odb does not replay batches).

The train dataset and the data collator are odb's (``OdbSettings.data``; under DPOTrainer and
RewardTrainer every record a preference pair): a ``train_dataset`` passed to the trainer is
refused. Evaluation stays the host's: its ``eval_dataset`` and collator, padded rows through the
model's own loss (odb's attention runs padded rows as the model's own SDPA does; under DPOTrainer
and RewardTrainer TRL's own evaluation, the reference model's rows too).
"""

from __future__ import annotations

from transformers import Trainer

from odb.integrations.dpo import OdbDPOMixin
from odb.integrations.hf_trainer import SCHEDULES, OdbTrainerMixin, check_arguments, schedule
from odb.integrations.reward import OdbRewardMixin

__all__ = ["OdbTrainer", "OdbTrainerMixin", "SCHEDULES", "check_arguments", "schedule", "with_odb"]


def with_odb(trainer_class: type) -> type:
    """``trainer_class`` (HF ``Trainer`` or a subclass: TRL's ``SFTTrainer``, ``DPOTrainer``, ...)
    with odb's batching: the class takes ``odb=OdbSettings(...)`` besides its own arguments. TRL's
    ``DPOTrainer`` trains its sigmoid, IPO and hinge losses over odb's packed pairs
    (:mod:`odb.integrations.dpo`), its ``RewardTrainer`` a Bradley-Terry reward model over them
    (:mod:`odb.integrations.reward`). A TRL trainer of another objective (CPO, ORPO, KTO, GRPO,
    ...) is refused: odb's host adapter backs next-token loss, DPO's or a reward model's, so it
    would train something else under that trainer's name."""
    trl = [c for c in trainer_class.__mro__ if c.__module__.split(".")[0] == "trl"]
    names = {c.__name__ for c in trl}
    if "DPOTrainer" in names:
        return type(f"Odb{trainer_class.__name__}", (OdbDPOMixin, trainer_class), {})
    if "RewardTrainer" in names:
        return type(f"Odb{trainer_class.__name__}", (OdbRewardMixin, trainer_class), {})
    if trl and "SFTTrainer" not in names:
        raise TypeError(f"with_odb({trainer_class.__name__}): {_refusal(trainer_class.__name__, names)}")
    return type(f"Odb{trainer_class.__name__}", (OdbTrainerMixin, trainer_class), {})


def _refusal(name: str, names: set[str]) -> str:
    """Why a TRL trainer of another objective (``name``, its TRL classes ``names``) is refused, and
    where odb trains it."""
    if names & {"CPOTrainer", "ORPOTrainer"}:
        return ("odb's Trainer adapter trains next-token loss (SFTTrainer), DPO's sigmoid, ipo and hinge "
                "(DPOTrainer) and a reward model (RewardTrainer); SimPO and ORPO run in odb's own loop: "
                "launch/train.py --objective simpo|orpo (docs/preference.md)")
    return (f"odb's Trainer adapter trains next-token loss (SFTTrainer), DPO's losses (DPOTrainer) and a reward "
            f"model (RewardTrainer) only, so {name}'s objective would silently become another; train preference "
            "objectives with with_odb(DPOTrainer), with_odb(RewardTrainer) or odb's own loop: launch/train.py "
            "--objective dpo|ipo|hinge|simpo|orpo|reward (docs/preference.md)")


OdbTrainer = with_odb(Trainer)
"""HF ``Trainer`` with odb's batching (:func:`with_odb`)."""
