"""with_odb(DPOTrainer) (odb.integrations.dpo) against TRL's own DPOTrainer, one process.

The oracle is TRL alone: a plain DPOTrainer over the same pairs (conversational rows, which TRL
renders with the chat template as odb does), its own tokenization, padded batches, eager attention
and loss code, each pair alone, the mean over the pairs backed once. One optimizer step of
with_odb(DPOTrainer) over odb's packed micro-batches of the same pairs (uneven lengths; several
pairs in a micro-batch, or a dummy micro-batch) must give the same loss (the host's logged one and odb's
metrics.jsonl) and the same gradient of every trained weight. References: a separate ref_model
(odb's reference 'model', its weights moved off the policy's) and a LoRA model's base (the adapter
disabled, its B moved off zero). Each DPOConfig field odb cannot keep is refused, naming the fix."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = Path(__file__).resolve().parents[2]
WORDS = "golden dragon open engine hammer wide winter window tunnel island early morning garden stone".split()
SHAPES = [(3, 2, 20), (12, 30, 1), (5, 5, 6), (20, 1, 2), (2, 40, 9)]
"""Words of each pair's prompt, chosen and rejected answer: very uneven."""
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def records() -> tuple[list[dict], list[dict]]:
    """The pairs as written to odb's data (plain and conversational rows in turn) and as the
    oracle's TRL dataset (each a conversation: what odb's chat template renders of a plain row)."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    plain, conversational = [], []
    for i, (p, c, r) in enumerate(SHAPES):
        prompt, chosen, rejected = text(p), text(c), text(r)
        turns = {"prompt": [{"role": "user", "content": prompt}],
                 "chosen": [{"role": "assistant", "content": chosen}],
                 "rejected": [{"role": "assistant", "content": rejected}]}
        plain.append(turns if i % 2 else {"prompt": prompt, "chosen": chosen, "rejected": rejected})
        conversational.append(turns)
    return plain, conversational


def tiny_model(tokenizer, *, attn: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def moved(model, seed: int):
    """``model``'s weights moved (a reference that is not the policy)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


HOST_ARGS = {"use_cpu": True, "report_to": [], "bf16": False, "per_device_train_batch_size": 1, "learning_rate": 1e-3,
             "max_grad_norm": 0.0, "gradient_checkpointing": False, "save_strategy": "no", "logging_steps": 1,
             "disable_tqdm": True, "num_train_epochs": 1}
"""A one-process CPU host's TrainingArguments (DPOConfig's, RewardConfig's), each test's beside."""


def dpo_config(out: Path, **values):
    from trl import DPOConfig

    return DPOConfig(**{"output_dir": str(out), **HOST_ARGS, **values})


def odb_settings(tmp_path: Path, rows: list[dict]):
    from odb.batching.config import OdbConfig
    from odb.integrations import OdbSettings
    from odb.training.config.settings import DataSettings

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return OdbSettings(data=DataSettings(path=str(data)), tokenizer=str(ROOT / "data" / "tokenizer"),
                       batching=OdbConfig(max_tokens=128, window=8, cost_model="manual"), audit_ids=True)


class Gradients:
    """A host callback: every trained weight's gradient just before the optimizer's step."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Grab(TrainerCallback):
            def __init__(self) -> None:
                self.grads: dict[str, torch.Tensor] = {}

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                self.grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

        return Grab()


def oracle(trainer, count: int) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's own loss of each pair alone (its collator, a padded batch of one pair), the mean over
    the pairs, and its gradients."""
    model = trainer.model.train()
    model.zero_grad()
    total = 0
    for i in range(count):
        row = trainer.train_dataset[i]
        batch = trainer.data_collator([{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        total = total + trainer.compute_loss(model, batch)
    mean = total / count
    mean.backward()
    return mean.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_step(trainer, grab, out: Path, want_loss: float, want_grads: dict[str, torch.Tensor], *,
               packed: bool) -> None:
    """One optimizer step of every pair, over several micro-batches (``packed``: one holds several
    pairs; else one is a dummy: the batcher spreads 5 pairs over 6), equal to the oracle."""
    audit = [json.loads(line) for line in (out / "emitted_ids.rank0.jsonl").read_text().splitlines()]
    assert {r["step"] for r in audit} == {0} and sorted(i for r in audit for i in r["ids"]) == list(range(len(SHAPES)))
    assert any(len(r["ids"]) > 1 for r in audit) if packed else any(not r["ids"] for r in audit), audit
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert trainer.state.log_history[0]["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert set(grab.grads) == set(want_grads) and want_grads
    for name, want in want_grads.items():
        torch.testing.assert_close(grab.grads[name], want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.5), ("ipo", 0.5), ("hinge", 0.05)])
def test_a_step_over_packed_pairs_against_a_ref_model_is_trls_loss_of_each_pair_alone(tmp_path, tokenizer,
                                                                                      loss_type, beta):
    """A full fine-tune with a separate ref_model (its weights moved off the policy's): odb runs it
    per micro-batch, packed; beta small enough for hinge that no pair is flat."""
    from datasets import Dataset
    from trl import DPOTrainer

    from odb.integrations.hf import with_odb

    plain, conversational = records()
    policy, reference = tiny_model(tokenizer), moved(tiny_model(tokenizer), seed=1)
    out = tmp_path / "odb"
    grab = Gradients()
    trainer = with_odb(DPOTrainer)(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference),
                                   args=dpo_config(out, gradient_accumulation_steps=4, beta=beta, loss_type=loss_type),
                                   processing_class=tokenizer, odb=odb_settings(tmp_path, plain), callbacks=[grab])
    eager = moved(tiny_model(tokenizer, attn="eager"), seed=1)
    want = DPOTrainer(model=tiny_model(tokenizer, attn="eager"), ref_model=eager,
                      args=dpo_config(tmp_path / "trl", beta=beta, loss_type=loss_type, max_length=None),
                      processing_class=tokenizer, train_dataset=Dataset.from_list(conversational))
    if loss_type == "sigmoid":  # the host's evaluation: TRL's, on its padded batches, through odb's attention
        evaluated = Dataset.from_list(conversational)
        assert trainer.evaluate(eval_dataset=evaluated)["eval_loss"] == pytest.approx(
            want.evaluate(eval_dataset=evaluated)["eval_loss"], rel=1e-5)
    want_loss, want_grads = oracle(want, len(SHAPES))
    trainer.train()
    check_step(trainer, grab, out, want_loss, want_grads, packed=True)
    assert abs(want_loss - 0.6931) > 1e-3 or loss_type != "sigmoid"  # (the policy is not its reference)


def test_a_step_of_a_lora_model_against_its_base_is_trls_loss_of_each_pair_alone(tmp_path, tokenizer):
    """peft_config, no ref_model: the reference is the base model (odb's 'adapter'); the adapter's B
    moved off zero so that policy and base differ; TRL's default gradient checkpointing on."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOTrainer

    from odb.integrations.hf import with_odb

    plain, conversational = records()
    out = tmp_path / "odb"
    grab = Gradients()
    args = dpo_config(out, gradient_accumulation_steps=6, beta=0.5, gradient_checkpointing=True)
    trainer = with_odb(DPOTrainer)(model=tiny_model(tokenizer), args=args, processing_class=tokenizer,
                                   odb=odb_settings(tmp_path, plain), peft_config=LoraConfig(**LORA), callbacks=[grab])
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    want = DPOTrainer(model=tiny_model(tokenizer, attn="eager"), peft_config=LoraConfig(**LORA),
                      args=dpo_config(tmp_path / "trl", beta=0.5, max_length=None),
                      processing_class=tokenizer, train_dataset=Dataset.from_list(conversational))
    want.model.load_state_dict(trainer.model.state_dict())
    want_loss, want_grads = oracle(want, len(SHAPES))
    trainer.train()
    assert all("lora_" in name for name in grab.grads)
    check_step(trainer, grab, out, want_loss, want_grads, packed=False)
    assert abs(want_loss - 0.6931) > 1e-3


@pytest.mark.parametrize("values,fix", [
    ({"loss_type": "robust"}, "loss_type to one of"),
    ({"loss_type": ["sigmoid", "sft"]}, "one DPO loss at a time"),
    ({"loss_type": ["sigmoid"], "loss_weights": [0.5]}, "leave loss_weights unset"),
    ({"label_smoothing": 0.1}, "set label_smoothing=0"),
    ({"ld_alpha": 0.5}, "leave ld_alpha unset"),
    ({"f_divergence_type": "js_divergence"}, "leave f_divergence_type at 'reverse_kl'"),
    ({"use_weighting": True}, "set use_weighting=False"),
    ({"precompute_ref_log_probs": True}, "--reference precompute"),
    ({"sync_ref_model": True}, "set sync_ref_model=False"),
    ({"router_aux_loss_coef": 0.01}, "router_aux_loss_coef=0.0"),
    ({"max_length": 512}, "OdbSettings.batching.max_tokens"),
    ({"truncation_mode": "keep_end"}, "leave truncation_mode at 'keep_start'"),
    ({"dataset_num_proc": 4}, "DataSettings\\(num_workers"),
    ({"label_smoothing_factor": 0.1}, "set label_smoothing_factor=0"),
    ({"per_device_train_batch_size": 4}, "max_tokens"),
])
def test_a_dpo_argument_odb_cannot_keep_is_refused_naming_the_fix(tmp_path, tokenizer, values, fix):
    """Through the trainer, before TRL's own start (a field TRL acts on at start: precompute, a
    reference to load) or after it (TrainingArguments' own, as for SFT)."""
    from trl import DPOTrainer

    from odb.integrations.hf import with_odb

    with pytest.raises(ValueError, match=fix):
        with_odb(DPOTrainer)(model=tiny_model(tokenizer), ref_model=tiny_model(tokenizer),
                             args=dpo_config(tmp_path, **values), processing_class=tokenizer,
                             odb=odb_settings(tmp_path, records()[0]))


def test_the_dpo_fields_odb_keeps_pass_and_map_to_its_objective(tmp_path):
    from odb.integrations.dpo import preference_objective

    for loss_type, name in (("sigmoid", "dpo"), (["ipo"], "ipo"), ("hinge", "hinge")):
        mapped = preference_objective(dpo_config(tmp_path, loss_type=loss_type, beta=0.3, max_length=None,
                                                 padding_free=True, loss_weights=[1.0], router_aux_loss_coef=0.0))
        assert (mapped.objective, mapped.beta) == (name, 0.3)


def test_a_reference_odb_cannot_run_as_trl_does_is_refused(tmp_path, tokenizer):
    """A PeftModel whose adapter starts trained (TRL's reference: a copy of it; odb's: the base),
    a non-LoRA adapter, a full fine-tune without ref_model on a model with no path to load one from
    are refused; a PeftModel whose adapter starts at PEFT's own init (B zero) has its base model
    as the reference, a full fine-tune of a model with a path the reference TRL loads from it."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from trl import DPOTrainer

    from odb.integrations.hf import with_odb

    odb = odb_settings(tmp_path, records()[0])
    trainer_class = with_odb(DPOTrainer)
    fresh = get_peft_model(tiny_model(tokenizer), LoraConfig(**LORA))
    trainer = trainer_class(model=fresh, args=dpo_config(tmp_path), processing_class=tokenizer, odb=odb)
    assert trainer._odb_objective()["objective"].reference == "adapter"
    trained = get_peft_model(tiny_model(tokenizer), LoraConfig(**LORA))
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    with pytest.raises(ValueError, match="merge_and_unload"):
        trainer_class(model=trained, args=dpo_config(tmp_path), processing_class=tokenizer, odb=odb)
    with pytest.raises(ValueError, match="LoraConfig adapter, or pass ref_model="):
        trainer_class(model=tiny_model(tokenizer), args=dpo_config(tmp_path), processing_class=tokenizer, odb=odb,
                      peft_config=IA3Config(target_modules=["v_proj"], feedforward_modules=[]))
    with pytest.raises(ValueError, match="pass ref_model="):
        trainer_class(model=tiny_model(tokenizer), args=dpo_config(tmp_path), processing_class=tokenizer, odb=odb)
    saved = tmp_path / "model"  # a full fine-tune of a model with a path: TRL loads its reference from it
    tiny_model(tokenizer).save_pretrained(saved)
    from transformers import AutoModelForCausalLM

    trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(saved), args=dpo_config(tmp_path),
                            processing_class=tokenizer, odb=odb)
    assert trainer._odb_objective()["objective"].reference == "model" and trainer._odb_reference() is not None
    with pytest.raises(ValueError, match="drop train_dataset"):
        trainer_class(model=tiny_model(tokenizer), ref_model=tiny_model(tokenizer), args=dpo_config(tmp_path),
                      processing_class=tokenizer, odb=odb, train_dataset=records()[1])


def test_trl_trainers_of_other_objectives_stay_refused():
    from trl import DPOTrainer, RewardTrainer, SFTTrainer
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from odb.integrations.hf import with_odb

    for trainer in (CPOTrainer, ORPOTrainer):
        with pytest.raises(TypeError, match="--objective simpo\\|orpo"):
            with_odb(trainer)
    assert with_odb(DPOTrainer).__name__ == "OdbDPOTrainer" and with_odb(SFTTrainer).__name__ == "OdbSFTTrainer"
    assert with_odb(RewardTrainer).__name__ == "OdbRewardTrainer"  # (tests/unit/test_integrations_reward.py)
