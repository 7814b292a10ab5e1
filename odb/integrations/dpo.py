"""``with_odb(DPOTrainer)``: TRL's DPO trainer over odb's packed pairs (:mod:`odb.integrations.hf`
for what every host argument means; this module adds DPO's).

    trainer = with_odb(DPOTrainer)(model=model, args=DPOConfig(..., beta=0.1, loss_type="sigmoid"),
                                   processing_class=tokenizer, peft_config=LoraConfig(...),
                                   odb=OdbSettings(data=DataSettings(path="pairs.jsonl"),
                                                   batching=OdbConfig(max_tokens=8192)))
    trainer.train()

The data is odb's, as for SFT: ``OdbSettings.data`` names the records, TRL's preference rows
(``{"prompt", "chosen", "rejected"}``, plain or conversational, also the other formats of
:mod:`odb.data.preference`), each read as one pair sample: its chosen and its rejected sequence
rendered with the chat template (a plain string prompt is one user turn, a plain answer one
assistant turn), labels on the answers, both in the same micro-batch (:mod:`odb.data.processing`,
``pairs=True``). TRL's DPOTrainer concatenates a plain row's text with an EOS instead: odb trains
the conversation the chat template makes of it. A ``train_dataset`` is refused.

The loss is odb's (:class:`odb.training.step.preference.PreferenceTally`): each micro-batch backs
``sum_p loss_p * W / P_s``, ``P_s`` the step's pairs over every rank, so a step trains the mean
over its pairs on all ranks, as odb's own loop does; TRL takes the mean over each device's batch.

The reference (TRL's, kept where odb runs the same math):

* a PEFT model (``peft_config``, or a ``PeftModel`` whose adapter starts as the identity: every
  LoRA ``B`` zero) and no ``ref_model``: the base model, the adapter disabled, one forward without
  gradients per micro-batch (odb's reference ``adapter``). A ``PeftModel`` whose adapter starts
  trained is refused: TRL's reference is then a frozen copy of that adapter, not the base model.
* a ``ref_model``, or a full fine-tune without one (TRL then loads the model's path again as its
  reference): that model's own forward per micro-batch, packed as the policy's, through its own LM
  head (odb's reference ``model``, :data:`odb.training.config.objective.HOST_REFERENCES`).
* ``precompute_ref_log_probs``: refused; TRL's pass runs over its own ``train_dataset``. odb's own
  loop has the pass: ``launch/train.py --objective dpo --reference precompute``.

DPOConfig's own fields (TRL 1.16), each kept, mapped or refused by :func:`preference_objective`
(a refusal is a ``ValueError`` naming the fix):

=============================  ===========================================================
``beta``                       mapped: odb's ``beta``
``loss_type``                  mapped, one value: ``sigmoid`` -> ``dpo``, ``ipo``, ``hinge``;
                               another, or a list of several, refused (odb's: :data:`LOSS_TYPES`)
``loss_weights``               None or ``[1.0]``; else refused
``label_smoothing``            0; else refused (TRL's robust, exo_pair and aot read it)
``ld_alpha``                   None; else refused
``f_divergence_type``          ``reverse_kl``; else refused (``f_alpha_divergence_coef`` acts
                               only with ``alpha_divergence``)
``use_weighting``              False; else refused (WPO)
``discopop_tau``               acts only with ``loss_type='discopop'`` (refused)
``precompute_ref_log_probs``   False; else refused (``precompute_ref_batch_size`` acts only with it)
``sync_ref_model``             False; else refused (TR-DPO; ``ref_model_mixup_alpha``,
                               ``ref_model_sync_steps`` act only with it)
``router_aux_loss_coef``       a mixture-of-experts model's router loss is not added under a
                               preference objective: refused unless it is off (0.0)
``max_length``                 odb's cap is ``max_tokens`` (a longer pair: ``over_cap``, its
                               answers cut at their ends, never the prompt): the default (1024)
                               and None are left unused, another value is refused
``truncation_mode``            ``keep_start``; ``keep_end`` refused (odb keeps the prompt)
``dataset_num_proc``           None; else refused (odb's DataLoader workers:
                               ``DataSettings(num_workers=...)``)
``padding_free``               kept: odb's rows are packed, without padding, either way
``pad_to_multiple_of``         the host's evaluation batches (TRL's collator); odb's rows pack
``disable_dropout``            kept (TRL's, on the model and the reference model)
``model_init_kwargs``,         kept (TRL's, where the model is given by name)
``trust_remote_code``
``activation_offloading``      kept: TRL's context around each training step (untested here)
``pad_token``                  kept (deprecated in TRL: the tokenizer's)
=============================  ===========================================================
"""

from __future__ import annotations

from typing import Any

from odb.integrations.core import HostModel, OdbSettings
from odb.integrations.hf_trainer import OdbTrainerMixin
from odb.training.attention.varlen import register
from odb.training.config.objective import ObjectiveSettings

__all__ = ["LOSS_TYPES", "OdbDPOMixin", "preference_objective"]

LOSS_TYPES = {"sigmoid": "dpo", "ipo": "ipo", "hinge": "hinge"}
"""TRL DPO's ``loss_type`` -> odb's preference loss of the same formula
(:mod:`odb.training.step.preference`)."""

_MAX_LENGTH = 1024  # (DPOConfig's default max_length)


def preference_objective(args: Any) -> ObjectiveSettings:
    """odb's objective from a ``DPOConfig`` (the module docstring's table); ``ValueError`` naming
    the fix where a field cannot keep its meaning. The reference is set by :class:`OdbDPOMixin`
    from the models."""
    losses = list(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
    if len(losses) != 1 or losses[0] not in LOSS_TYPES:
        raise ValueError(f"loss_type={args.loss_type!r}: odb trains one DPO loss at a time, one of "
                         f"{sorted(LOSS_TYPES)} (as odb's dpo, ipo, hinge); set loss_type to one of them (SimPO and "
                         "ORPO: odb's own loop, launch/train.py --objective simpo|orpo)")
    refused = [(name, value, fix) for name, value, fix in (
        ("loss_weights", args.loss_weights if args.loss_weights not in (None, [1.0], (1.0,)) else None,
         "leave loss_weights unset (one loss, weight 1)"),
        ("label_smoothing", args.label_smoothing or None, "set label_smoothing=0 (robust and EXO DPO are not odb's)"),
        ("ld_alpha", args.ld_alpha, "leave ld_alpha unset (LD-DPO's length weighting is not odb's)"),
        ("f_divergence_type", None if args.f_divergence_type == "reverse_kl" else args.f_divergence_type,
         "leave f_divergence_type at 'reverse_kl' (standard DPO)"),
        ("use_weighting", args.use_weighting or None, "set use_weighting=False (WPO's weights are not odb's)"),
        ("precompute_ref_log_probs", args.precompute_ref_log_probs or None,
         "TRL's pass runs over its train_dataset, and the data is odb's: leave it off (the reference runs per "
         "micro-batch: a PEFT model's base, or ref_model), or precompute in odb's own loop: launch/train.py "
         "--objective dpo --reference precompute"),
        ("sync_ref_model", args.sync_ref_model or None, "set sync_ref_model=False (odb's reference stays fixed)"),
        ("router_aux_loss_coef", args.router_aux_loss_coef or None,
         "odb adds no router loss under a preference objective: set router_aux_loss_coef=0.0"),
        ("max_length", None if args.max_length in (None, _MAX_LENGTH) else args.max_length,
         "odb's cap is OdbSettings.batching.max_tokens (a pair over it: over_cap, its answers cut at their ends): "
         "set that, and leave max_length unset"),
        ("truncation_mode", None if args.truncation_mode == "keep_start" else args.truncation_mode,
         "odb keeps a pair's prompt and cuts its answers' ends (over_cap truncate): leave truncation_mode at "
         "'keep_start'"),
        ("dataset_num_proc", args.dataset_num_proc,
         "odb processes the records in its DataLoader workers: set DataSettings(num_workers=...) instead"),
    ) if value is not None]
    if refused:
        raise ValueError("; ".join(f"{name}={value!r}: {fix}" for name, value, fix in refused))
    return ObjectiveSettings(objective=LOSS_TYPES[losses[0]], beta=args.beta)


def _peft_model(model: Any) -> Any | None:
    """``model`` as a PEFT model, or None."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return model if isinstance(model, PeftModel) else None


def _lora_settings(peft: Any) -> dict[str, Any]:
    """The host's active LoRA adapter's settings, as odb records a LoRA run's (``ModelSettings.lora``)."""
    from peft import LoraConfig

    config = peft.peft_config[peft.active_adapter]
    if not isinstance(config, LoraConfig):
        raise ValueError(f"a {type(config).__name__} adapter: odb's reference 'adapter' (the base model, the adapter "
                         "disabled) is built and tested for LoRA; train a LoraConfig adapter, or pass ref_model=")
    targets = config.target_modules
    return {"r": config.r, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout,
            "target_modules": sorted(targets) if isinstance(targets, (set, frozenset)) else targets}


def _starts_as_identity(peft: Any) -> bool:
    """Whether the active LoRA adapter adds nothing yet (every ``B`` zero, PEFT's own start): the
    base model is then the policy as it starts."""
    name = peft.active_adapter
    zeros = [not param.detach().any() for key, param in peft.named_parameters()
             if f"lora_B.{name}." in key or f"lora_embedding_B.{name}" in key]
    return bool(zeros) and all(zeros)


class OdbDPOMixin(OdbTrainerMixin):
    """What :func:`odb.integrations.hf.with_odb` adds to TRL's ``DPOTrainer`` (the module docstring)."""

    odb_next_token = False  # (its loss fields are DPOConfig's: preference_objective)

    def __init__(self, *args: Any, odb: OdbSettings, **kwargs: Any) -> None:
        bound = self._host_arguments(args, kwargs)
        given = bound.get("args")
        if given is not None:  # before TRL's own start (which would load a reference, or precompute)
            preference_objective(given)
        model, ref_model = bound.get("model"), bound.get("ref_model")
        if ref_model is None and bound.get("peft_config") is None and _peft_model(model) is None and \
                not isinstance(model, str) and not getattr(model.config, "_name_or_path", ""):
            raise ValueError("a full fine-tune without ref_model: TRL loads the reference from the model's path, and "
                             "this model has none (built from a config); pass ref_model= (a copy of the model as it "
                             "starts), or train LoRA (peft_config=: the reference is the base model)")
        super().__init__(odb=odb, **bound)
        objective = preference_objective(self.args)
        peft = _peft_model(self.model)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("router_aux_loss_coef: TRL adds this mixture-of-experts model's router loss by default "
                             "(its config's coefficient), and odb adds none under a preference objective: set "
                             "router_aux_loss_coef=0.0")
        self._odb_reference_model: HostModel | None = None
        lora = None
        if self.ref_model is not None:
            module = self.accelerator.unwrap_model(self.ref_model)
            module.set_attn_implementation(register())  # its packed rows too: each sequence attends to itself
            self._odb_reference_model = HostModel(module, self.args.device)
            self._odb_reference_model.call = self.ref_model  # (as TRL wrapped it: DeepSpeed, DDP, none)
            reference = "model"
        else:  # a PEFT model: TRL's reference is its base, or a copy of the adapter it started with ("ref")
            assert peft is not None, "TRL keeps a ref_model for a full fine-tune unless it precomputes (refused)"
            if "ref" in peft.peft_config and not _starts_as_identity(peft):
                raise ValueError("a PeftModel whose adapter is already trained: TRL's reference is a frozen copy of "
                                 "that adapter, odb's ('adapter') the base model without it; pass ref_model= (a copy "
                                 "with the adapter merged: merge_and_unload()), or the base model with peft_config=")
            lora, reference = _lora_settings(peft), "adapter"
        self._odb_objective_settings = ObjectiveSettings(objective=objective.objective, beta=objective.beta,
                                                         reference=reference)
        self._odb_lora = lora

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name: str):
        """TRL's tokenization, for the host's evaluation sets only: the training data is odb's (its
        stand-in is never read)."""
        if dataset_name == "train":
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _odb_objective(self) -> dict[str, Any]:
        return {"objective": self._odb_objective_settings, "lora": self._odb_lora}

    def _odb_reference(self) -> HostModel | None:
        return self._odb_reference_model
