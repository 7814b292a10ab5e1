"""with_odb(RewardTrainer) (odb.integrations.reward) against TRL's own RewardTrainer, one process.

The oracle is TRL alone: a plain RewardTrainer over the same pairs (conversational rows, which TRL
renders with the chat template as odb does), its own tokenization, collator (the pair's two rows
padded on the right), eager attention and ``compute_loss``, each pair alone, the mean over the
pairs backed once. One optimizer step of with_odb(RewardTrainer) over odb's packed micro-batches
of the same pairs (uneven lengths; several pairs in a micro-batch, or a dummy micro-batch) must
give the same loss (the host's logged one and odb's metrics.jsonl) and the same gradient of every
trained weight: a full fine-tune, with TRL's centering term, and LoRA (PEFT's SEQ_CLS task: the
score head trained whole). Each RewardConfig field, model or data odb cannot keep is refused,
naming the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_integrations_dpo import HOST_ARGS, SHAPES, Gradients, check_step, odb_settings, records

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = Path(__file__).resolve().parents[2]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
        "task_type": "SEQ_CLS"}


def tiny_classifier(tokenizer, *, attn: str = "sdpa", num_labels: int = 1):
    """A tiny llama sequence classifier, its score head moved off its init (rewards of about 1,
    which differ between the answers)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    return model


def reward_config(out: Path, **values):
    from trl import RewardConfig

    return RewardConfig(**{"output_dir": str(out), **HOST_ARGS, **values})


def oracle(trainer, count: int) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's own loss of each pair alone (its collator: the pair's two rows, padded), the mean over
    the pairs, and its gradients."""
    model = trainer.model.train()
    model.zero_grad()
    total = 0
    for i in range(count):
        row = trainer.train_dataset[i]
        batch = trainer.data_collator([{k: row[k] for k in ("chosen_ids", "rejected_ids")}])
        total = total + trainer.compute_loss(model, batch)
    mean = total / count
    mean.backward()
    return mean.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("center", [None, 0.05], ids=["plain", "centered"])
def test_a_step_over_packed_pairs_is_trls_reward_loss_of_each_pair_alone(tmp_path, tokenizer, center):
    """A full fine-tune, several pairs to a micro-batch; ``centered``: TRL's centering term, odb's
    per pair. The host's evaluation is TRL's, on its padded rows, through odb's attention."""
    from datasets import Dataset
    from trl import RewardTrainer

    from odb.integrations.hf import with_odb

    plain, conversational = records()
    out = tmp_path / "odb"
    grab = Gradients()
    trainer = with_odb(RewardTrainer)(
        model=tiny_classifier(tokenizer), processing_class=tokenizer, odb=odb_settings(tmp_path, plain),
        args=reward_config(out, gradient_accumulation_steps=4, center_rewards_coefficient=center), callbacks=[grab])
    want = RewardTrainer(model=tiny_classifier(tokenizer, attn="eager"), processing_class=tokenizer,
                         args=reward_config(tmp_path / "trl", center_rewards_coefficient=center, max_length=None),
                         train_dataset=Dataset.from_list(conversational))
    evaluated = Dataset.from_list(conversational)
    assert trainer.evaluate(eval_dataset=evaluated)["eval_loss"] == pytest.approx(
        want.evaluate(eval_dataset=evaluated)["eval_loss"], rel=1e-5)
    want_loss, want_grads = oracle(want, len(SHAPES))
    trainer.train()
    check_step(trainer, grab, out, want_loss, want_grads, packed=True)
    assert abs(want_loss - 0.6931) > 1e-2  # (the rewards differ: log 2 where they are equal)
    assert any("score" in name for name in grab.grads)
    if center:  # (the term counts: TRL's loss without it is another)
        want.args.center_rewards_coefficient = None
        assert abs(oracle(want, len(SHAPES))[0] - want_loss) > 1e-3


def test_a_step_of_a_lora_reward_model_is_trls_loss_of_each_pair_alone(tmp_path, tokenizer):
    """peft_config with PEFT's SEQ_CLS task (the adapter and the score head trained, the head as a
    whole copy), TRL's default gradient checkpointing on; a dummy micro-batch (5 pairs over 6)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import RewardTrainer

    from odb.integrations.hf import with_odb

    plain, conversational = records()
    out = tmp_path / "odb"
    grab = Gradients()
    args = reward_config(out, gradient_accumulation_steps=6, gradient_checkpointing=True)
    trainer = with_odb(RewardTrainer)(model=tiny_classifier(tokenizer), args=args, processing_class=tokenizer,
                                      odb=odb_settings(tmp_path, plain), peft_config=LoraConfig(**LORA),
                                      callbacks=[grab])
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    want = RewardTrainer(model=tiny_classifier(tokenizer, attn="eager"), peft_config=LoraConfig(**LORA),
                         args=reward_config(tmp_path / "trl", max_length=None), processing_class=tokenizer,
                         train_dataset=Dataset.from_list(conversational))
    want.model.load_state_dict(trainer.model.state_dict())
    want_loss, want_grads = oracle(want, len(SHAPES))
    trainer.train()
    assert all("lora_" in name or "score" in name for name in grab.grads)
    assert any("score" in name for name in grab.grads) and any("lora_" in name for name in grab.grads)
    check_step(trainer, grab, out, want_loss, want_grads, packed=False)
    assert trainer._odb_objective()["lora"]["r"] == LORA["r"]


@pytest.mark.parametrize("values,fix", [
    ({"center_rewards_coefficient": -0.1}, "coefficient >= 0"),
    ({"max_length": 512}, "OdbSettings.batching.max_tokens"),
    ({"dataset_num_proc": 4}, "DataSettings\\(num_workers"),
    ({"chat_template_path": str(ROOT / "data" / "tokenizer")}, "leave chat_template_path unset"),
    ({"eos_token": "<|end|>"}, "leave eos_token unset"),
    ({"label_smoothing_factor": 0.1}, "set label_smoothing_factor=0"),
    ({"per_device_train_batch_size": 4}, "max_tokens"),
])
def test_a_reward_argument_odb_cannot_keep_is_refused_naming_the_fix(tmp_path, tokenizer, values, fix):
    """Through the trainer, before TRL's own start (RewardConfig's fields) or after it
    (TrainingArguments' own, as for SFT)."""
    from trl import RewardTrainer

    from odb.integrations.hf import with_odb

    with pytest.raises(ValueError, match=fix):
        with_odb(RewardTrainer)(model=tiny_classifier(tokenizer), args=reward_config(tmp_path, **values),
                                processing_class=tokenizer, odb=odb_settings(tmp_path, records()[0]))


def test_the_reward_fields_odb_keeps_pass_and_map_to_its_objective(tmp_path):
    from odb.integrations.reward import reward_objective

    for center, want in ((None, 0.0), (0.01, 0.01)):
        mapped = reward_objective(reward_config(tmp_path, center_rewards_coefficient=center, max_length=None,
                                                pad_to_multiple_of=8, disable_dropout=False,
                                                activation_offloading=False))
        assert (mapped.objective, mapped.center_rewards_coefficient) == ("reward", want)
    assert reward_objective(reward_config(tmp_path)).objective == "reward"  # (max_length's default: unused)


def test_a_model_or_data_odb_cannot_train_as_trl_does_is_refused(tmp_path, tokenizer):
    """A causal LM, a classifier of two labels, a config without pad_token_id, records with TRL's
    margin, an eval_dataset with a margin column and a train_dataset are refused, each naming the
    fix; a model given by its path is loaded by TRL as a one-label classifier and kept."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import RewardTrainer

    from odb.integrations.hf import with_odb
    from odb.integrations.reward import check_classifier

    plain, conversational = records()
    odb = odb_settings(tmp_path, plain)
    trainer_class = with_odb(RewardTrainer)
    args = reward_config(tmp_path)
    causal = AutoModelForCausalLM.from_config(tiny_classifier(tokenizer).config)
    with pytest.raises(ValueError, match="is no sequence classifier.*AutoModelForSequenceClassification"):
        trainer_class(model=causal, args=args, processing_class=tokenizer, odb=odb)
    with pytest.raises(ValueError, match="num_labels=2.*num_labels=1"):
        trainer_class(model=tiny_classifier(tokenizer, num_labels=2), args=args, processing_class=tokenizer, odb=odb)
    unpadded = tiny_classifier(tokenizer)
    unpadded.config.pad_token_id = None
    with pytest.raises(ValueError, match="no pad_token_id.*tokenizer.pad_token"):
        check_classifier(unpadded)
    margins = tmp_path / "margins"
    margins.mkdir()
    with pytest.raises(ValueError, match="has a 'margin'.*remove the margin"):
        trainer_class(model=tiny_classifier(tokenizer), args=args, processing_class=tokenizer,
                      odb=odb_settings(margins, [{**row, "margin": 0.5} for row in plain]))
    with pytest.raises(ValueError, match="eval_dataset has a 'margin' column"):
        trainer_class(model=tiny_classifier(tokenizer), args=args, processing_class=tokenizer, odb=odb,
                      eval_dataset=Dataset.from_list([{**row, "margin": 0.5} for row in conversational]))
    with pytest.raises(ValueError, match="drop train_dataset"):
        trainer_class(model=tiny_classifier(tokenizer), args=args, processing_class=tokenizer, odb=odb,
                      train_dataset=Dataset.from_list(conversational))
    saved = tmp_path / "model"
    tiny_classifier(tokenizer).save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    trainer = trainer_class(model=str(saved), args=args, processing_class=tokenizer, odb=odb)
    assert trainer.model.config.num_labels == 1 and trainer._odb_objective()["objective"].scores


def test_the_centering_term_is_refused_outside_a_reward_model():
    from odb.training.config.objective import ObjectiveSettings

    with pytest.raises(ValueError, match="centers a reward model's rewards"):
        ObjectiveSettings(objective="dpo", center_rewards_coefficient=0.01)
    assert ObjectiveSettings(objective="reward", center_rewards_coefficient=0.01).scores
