"""``with_odb(RewardTrainer)``: TRL's reward trainer over odb's packed pairs
(:mod:`odb.integrations.hf` for what every host argument means; this module adds the reward
model's).

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)   # or the path itself
    trainer = with_odb(RewardTrainer)(model=model, args=RewardConfig(..., center_rewards_coefficient=0.01),
                                      processing_class=tokenizer,
                                      peft_config=LoraConfig(task_type="SEQ_CLS", ...),
                                      odb=OdbSettings(data=DataSettings(path="pairs.jsonl"),
                                                      batching=OdbConfig(max_tokens=8192)))
    trainer.train()

The model is TRL's: a sequence classifier with one output (TRL builds it from a path with
``AutoModelForSequenceClassification``, ``num_labels=1``); a model of another class, or of more
labels, is refused naming the fix (:func:`check_classifier`). The data is odb's, as for DPO
(:mod:`odb.integrations.dpo`): ``OdbSettings.data`` names the pair records (TRL's
``{"prompt", "chosen", "rejected"}``, plain or conversational, or any format of
:mod:`odb.data.preference`), each read as one pair sample, its chosen and its rejected sequence
rendered with the chat template (a plain string prompt one user turn, a plain answer one assistant
turn), both in the same micro-batch. TRL's RewardTrainer concatenates a plain row's text and an EOS
without the template: odb trains the conversation the chat template makes of it. A
``train_dataset`` is refused; so is, for now, a ``margin`` in the records (TRL's ``margin`` column,
which it subtracts from each pair's reward difference: odb's own loop trains it, ``launch/train.py
--objective reward``, but the adapter's path is not tested with it), checked on each source's first
record at start (a TRL dataset's column is on every row), and a ``margin`` column in the host's
``eval_dataset`` (its evaluation would score another loss than training's).

The loss is odb's reward objective (:class:`odb.training.step.reward.Reward`): each sequence's
reward is the score head's output where the model's class pools it (its last token that is not the
model's ``pad_token_id``), read per packed segment; pair p's loss ``-log sigmoid(r_c - r_r) + c
(r_c + r_r)^2``; each micro-batch backs ``sum_p loss_p * W / P_s``,
``P_s`` the step's pairs over every rank, so a step trains the mean over its pairs on all ranks
(TRL: the mean over each device's batch). The host's evaluation is TRL's own, on its padded
batches (the model's class pools each row's last token that is not padding, by the
``pad_token_id`` TRL sets on the model's config).

RewardConfig's own fields (TRL 1.16), each kept, mapped or refused by :func:`reward_objective`
(a refusal is a ``ValueError`` naming the fix):

==============================  ==========================================================
``center_rewards_coefficient``  mapped: odb's ``center_rewards_coefficient`` (None: 0); a
                                negative one refused
``max_length``                  odb's cap is ``max_tokens`` (a longer pair: ``over_cap``,
                                its answers cut at their ends, or dropped with ``drop``, as
                                TRL drops a pair over ``max_length``): the default (1024)
                                and None are left unused, another value is refused
``dataset_num_proc``            None; else refused (``DataSettings(num_workers=...)``)
``chat_template_path``          None; else refused: odb renders the records with its
                                tokenizer's template (``OdbSettings.tokenizer``)
``eos_token``                   None; else refused: the template ends each turn in odb's
                                records, and TRL would change the evaluation's alone
``pad_to_multiple_of``          the host's evaluation batches (TRL's collator); odb's rows pack
``disable_dropout``             kept (TRL's, on the model)
``model_init_kwargs``,          kept (TRL's, where the model is given by name)
``trust_remote_code``
``activation_offloading``       kept: TRL's context around each training step (untested here)
``pad_token``                   kept (deprecated in TRL: the tokenizer's); the host's
                                evaluation pads with it, odb's packed rows have no padding
==============================  ==========================================================
"""

from __future__ import annotations

from typing import Any

import torch

from odb.integrations.core import OdbSettings
from odb.integrations.dpo import _lora_settings, _peft_model
from odb.integrations.hf_trainer import OdbTrainerMixin
from odb.training.config.objective import ObjectiveSettings
from odb.training.config.settings import DataSettings, SourceSpec
from odb.training.model.build import hf_model

__all__ = ["OdbRewardMixin", "check_classifier", "reward_objective"]

_MAX_LENGTH = 1024  # (RewardConfig's default max_length)


def reward_objective(args: Any) -> ObjectiveSettings:
    """odb's objective from a ``RewardConfig`` (the module docstring's table); ``ValueError``
    naming the fix where a field cannot keep its meaning."""
    center = args.center_rewards_coefficient
    refused = [(name, value, fix) for name, value, fix in (
        ("center_rewards_coefficient", center if center is not None and not center >= 0 else None,
         "the centering term draws the rewards toward zero with a coefficient >= 0 (TRL recommends 0.01): set "
         "one, or leave it unset"),
        ("max_length", None if args.max_length in (None, _MAX_LENGTH) else args.max_length,
         "odb's cap is OdbSettings.batching.max_tokens (a pair over it: over_cap, its answers cut at their ends, or "
         "dropped with over_cap='drop' as TRL drops it): set that, and leave max_length unset"),
        ("dataset_num_proc", args.dataset_num_proc,
         "odb processes the records in its DataLoader workers: set DataSettings(num_workers=...) instead"),
        ("chat_template_path", args.chat_template_path,
         "odb renders the records with its tokenizer's chat template: save a tokenizer with that template, name "
         "its folder in OdbSettings(tokenizer=...) and pass it as processing_class, and leave chat_template_path "
         "unset"),
        ("eos_token", args.eos_token,
         "odb's records end each turn as the chat template of its tokenizer does (OdbSettings.tokenizer); set the "
         "tokenizer's eos_token where you save it, and leave eos_token unset"),
    ) if value is not None]
    if refused:
        raise ValueError("; ".join(f"{name}={value!r}: {fix}" for name, value, fix in refused))
    return ObjectiveSettings(objective="reward", center_rewards_coefficient=float(center or 0.0))


def check_classifier(model: Any) -> None:
    """Raises ``ValueError`` naming the fix unless ``model`` (under PEFT: the model inside) is a
    sequence classifier with one output under a ``score`` head, which odb reads each packed
    sequence's reward from (:func:`odb.training.step.reward.sequence_scores`), and whose config
    has the ``pad_token_id`` the host's evaluation pools by."""
    base = hf_model(model)
    name = type(base).__name__
    head = getattr(base, "score", None)
    if not name.endswith("ForSequenceClassification") or not isinstance(head, torch.nn.Module):
        what = "has no 'score' head" if name.endswith("ForSequenceClassification") else "is no sequence classifier"
        raise ValueError(f"a {name} {what}: a reward model is its family's sequence classifier with one output under "
                         "a 'score' head (odb reads each sequence's reward there, at its last token); load it with "
                         "AutoModelForSequenceClassification.from_pretrained(path, num_labels=1), or pass the "
                         "model's path and TRL loads it so")
    labels = getattr(base.config, "num_labels", None)
    if labels != 1:
        raise ValueError(f"a {name} of num_labels={labels}: a reward model has one output, its reward; load it "
                         "with AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)")
    if base.config.get_text_config().pad_token_id is None:
        raise ValueError(f"{name}'s config has no pad_token_id, by which the host's evaluation finds each padded "
                         "row's last token (TRL sets it from the tokenizer's pad_token): set tokenizer.pad_token, "
                         "or model.config.pad_token_id")


def refuse_margins(data: DataSettings, eval_dataset: Any, *, cache_dir: str | None) -> None:
    """Raises ``ValueError`` where the records carry TRL's ``margin`` (each source's first record:
    a TRL dataset's column is on every row), or the host's ``eval_dataset`` has a ``margin``
    column: not tested under the adapter yet (odb's own loop trains it)."""
    from odb.data.sources import Source

    fix = ("RewardTrainer subtracts a 'margin' from each pair's reward difference, which with_odb(RewardTrainer) "
           "does not take yet; remove the margin, or train with odb's own loop (launch/train.py --objective reward "
           "subtracts each record's margin)")
    if not data.streaming:  # (a streaming source is refused at the run's start, host_config)
        for source in data.sources or (SourceSpec("data", data.path),):
            record = Source(source.path, cache_dir=cache_dir).get(0)
            if record.value is not None and "margin" in record.value:
                raise ValueError(f"{record.where} has a 'margin': {fix}")
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    for name, dataset in named:
        if "margin" in (getattr(dataset, "column_names", None) or []):
            raise ValueError(f"{name} has a 'margin' column: {fix}")


class OdbRewardMixin(OdbTrainerMixin):
    """What :func:`odb.integrations.hf.with_odb` adds to TRL's ``RewardTrainer`` (the module docstring)."""

    odb_next_token = False  # (its loss field is RewardConfig's: reward_objective)

    def __init__(self, *args: Any, odb: OdbSettings, **kwargs: Any) -> None:
        bound = self._host_arguments(args, kwargs)
        given = bound.get("args")
        if given is not None:  # before TRL's own start (which loads and tokenizes)
            reward_objective(given)
        model = bound.get("model")
        if not isinstance(model, str):  # (before TRL's own num_labels check, whose fix misses the class)
            check_classifier(model)
        refuse_margins(odb.data, bound.get("eval_dataset"), cache_dir=getattr(given, "output_dir", None))
        super().__init__(odb=odb, **bound)
        self._odb_objective_settings = reward_objective(self.args)
        check_classifier(self.model)
        peft = _peft_model(self.model)
        self._odb_lora = None
        if peft is not None and type(peft.peft_config[peft.active_adapter]).__name__ == "LoraConfig":
            self._odb_lora = _lora_settings(peft)  # (the run's record; a reward model has no reference)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name: str):
        """TRL's tokenization, for the host's evaluation sets only: the training data is odb's (its
        stand-in is never read)."""
        if dataset_name == "train":
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _odb_objective(self) -> dict[str, Any]:
        return {"objective": self._odb_objective_settings, "lora": self._odb_lora}
