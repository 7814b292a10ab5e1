"""A Bradley-Terry reward model over packed pairs (odb.training.step.reward) against TRL's own
RewardTrainer.compute_loss on each pair alone (its two rows padded as TRL's collator pads them,
through the family's own sequence-classifier class with eager attention, which pools each row's
last real token): the step's loss (the mean over its pairs), its rewards and every gradient. Full
fine-tuning and LoRA (the score head trained whole), packed and padded micro-batches, a dummy;
the export loads with AutoModelForSequenceClassification and scores as the trained model does."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from test_preference_loss import check_equal, plan_of
from transformers import AutoModelForSequenceClassification

from odb.training.backends import LocalBackend
from odb.training.model.build import build_model, hf_model
from odb.training.step.engine import OdbEngine
from odb.training.step.objectives import objective_of
from odb.training.step.reward import Reward
from preference_oracle import pair, trl_reward_loss

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def reward_model(lora=None):
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=VOCAB, score_head=True, lora=lora)
    with torch.no_grad():  # the score head (and LoRA's B) off their init, so rewards differ and move
        for name, p in model.named_parameters():
            if "score" in name or "lora_B" in name:
                p.normal_(0, 0.5 if "score" in name else 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def engine_of(model, center: float = 0.0, **kwargs):
    return OdbEngine(LocalBackend(model), world_size=1, max_tokens=512, pad_token_id=0, loss_chunk_tokens=None,
                     objective=Reward(center=center), **kwargs)


def odb_step(model, micro_samples, padded: int = -1, center: float = 0.0):
    model.zero_grad()
    engine = engine_of(model, center)
    plan = plan_of(micro_samples, padded)
    tally = engine.tally(plan)
    for micro, samples in zip(plan.micro_batches, [*micro_samples, []], strict=True):
        tally.loss(micro, samples).backward()
    result = tally.result(lr=0.0)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return result.loss_sum / plan.num_samples, grads, result


def trl_step(model, samples, center: float | None = None):
    model.zero_grad()
    hf_model(model).set_attn_implementation("eager")
    losses, rewards = zip(*(trl_reward_loss(model, sample, center=center) for sample in samples))
    mean = torch.stack(losses).mean()
    mean.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(mean.detach()), grads, torch.stack(rewards)


@pytest.mark.parametrize("lora,center", [(None, None), (LORA, None), (None, 0.3)], ids=["full", "lora", "centered"])
def test_packed_pairs_train_trls_reward_loss_of_each_pair_alone(lora, center):
    """Three micro-batches of 3, 2 and 1 pairs (the second padded), a dummy; ``centered``: TRL's
    center_rewards_coefficient, odb's per-pair centering term."""
    rng = random.Random(3)
    samples = [pair(rng, uid, ref=False) for uid in range(6)]
    micro_samples = [samples[:3], samples[3:5], samples[5:]]
    model = reward_model(lora)
    got_loss, got_grads, result = odb_step(copy.deepcopy(model), micro_samples, padded=1, center=center or 0.0)
    want_loss, want_grads, rewards = trl_step(copy.deepcopy(model), samples, center)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert abs(want_loss - 0.6931) > 1e-2  # the rewards differ (log 2 where they are equal)
    if center is None:
        check_equal(got_grads, want_grads)
    else:  # (rewards of about 8: the centering term's gradients are some 100 times larger, fp32's noise too)
        assert set(got_grads) == set(want_grads)
        for name, want in want_grads.items():
            torch.testing.assert_close(got_grads[name], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()),
                                       msg=lambda m, n=name: f"{n}: {m}")
        uncentered, _, _ = trl_step(copy.deepcopy(model), samples)
        assert want_loss - uncentered > 1.0  # (the term counts)
    score = [name for name in got_grads if "score" in name]
    assert score and all(got_grads[name].abs().sum() > 0 for name in score)  # the head trains
    if lora is not None:
        assert all("lora_" in name or "score" in name for name in got_grads)
    chosen, rejected, right = result.rewards
    assert chosen == pytest.approx(float(rewards[:, 0].sum()), rel=1e-5, abs=1e-5)
    assert rejected == pytest.approx(float(rewards[:, 1].sum()), rel=1e-5, abs=1e-5)
    assert right == int((rewards[:, 0] > rewards[:, 1]).sum())


def test_a_cut_sequence_is_scored_at_its_last_kept_token():
    """max_tokens cuts each sequence (over_cap truncate, as the engine collates): the reward is the
    head's at the last token kept, as the class scores the cut sequence alone."""
    rng = random.Random(5)
    samples = [pair(rng, uid, ref=False) for uid in range(3)]
    model = reward_model()
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=8, pad_token_id=0, loss_chunk_tokens=None,
                       objective=Reward())
    with torch.no_grad():
        _, rewards = Reward().pairs(engine, plan_of([samples]).micro_batches[0], samples)
        alone = copy.deepcopy(model)
        alone.config.pad_token_id = None  # one row: its last token
        want = [[float(alone(input_ids=seq[:8][None]).logits[0, 0]) for seq in
                 (s["input_ids"][:s["pair"][0]], s["input_ids"][s["pair"][0]:])] for s in samples]
    torch.testing.assert_close(rewards, torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_the_export_is_a_sequence_classifier_that_scores_as_trained(tmp_path):
    from conftest import bundled_tokenizer
    from odb.training.export import write_hf

    model = reward_model(LORA)
    engine = engine_of(model)
    out = tmp_path / "hf"
    write_hf({k: v.clone() for k, v in model.state_dict().items()}, model_path=ROOT / "configs" / "tiny_model.json",
             lora=LORA, tokenizer=bundled_tokenizer(), out=out, score_head=True)
    loaded = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == model.config.pad_token_id == 0
    samples = [pair(random.Random(9), uid, ref=False) for uid in range(2)]
    with torch.no_grad():
        _, trained = Reward().pairs(engine, plan_of([samples]).micro_batches[0], samples)
        exported = torch.stack([trl_reward_loss(loaded, s, pad_token_id=loaded.config.pad_token_id)[1]
                                for s in samples])
    torch.testing.assert_close(exported, trained, rtol=1e-4, atol=1e-4)


def test_a_model_without_a_sequence_classifier_class_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="reward.*no class for with qwen2_vl"):
        build_model(ROOT / "configs" / "tiny_vl_model.json", seed=0, vocab_size=VOCAB, score_head=True)


def test_a_beta_given_to_a_reward_model_is_refused_and_its_reference_is_none(tmp_path):
    from conftest import train_defaults
    from odb.training.launch.flags import parse_config

    with pytest.raises(ValueError, match="--objective reward has no beta"):
        parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "reward", "--beta", "0.5"],
                     defaults=train_defaults())
    with pytest.raises(ValueError, match="reference free: --reference none"):
        parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "reward", "--reference", "adapter"],
                     defaults=train_defaults())
    config = parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "reward"], defaults=train_defaults())
    assert config.objective.scores and config.objective.reference_for(lora=True) == "none"
    with pytest.raises(ValueError, match="centers a reward model's rewards"):
        parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "simpo", "--center_rewards_coefficient",
                      "0.01"], defaults=train_defaults())
    config = parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "reward", "--center_rewards_coefficient",
                           "0.01"], defaults=train_defaults())
    assert objective_of(config) == Reward(center=0.01)


def test_where_the_pad_token_is_the_end_of_sequence_the_token_before_it_is_scored_as_the_class_does():
    """A tokenizer without a pad token pads with its eos (odb's default: Llama 3, Mistral), and a
    chat sequence ends in it: the family's class (the export, TRL) pools the last token that is not
    the pad token, so training must score that one too. With records' margins (TRL's column)."""
    eos = 2
    rng = random.Random(13)
    samples = []
    for uid in range(4):
        sample = pair(rng, uid, ref=False)
        chosen = sample["pair"][0]
        parts = [sample["input_ids"][:chosen], sample["input_ids"][chosen:]]
        labels = [sample["labels"][:chosen], sample["labels"][chosen:]]
        ids = [torch.cat([p, torch.tensor([eos])]) for p in parts]
        sample.update(input_ids=torch.cat(ids), labels=torch.cat([torch.cat([lab, torch.tensor([eos])])
                                                                  for lab in labels]),
                      pair=(len(ids[0]), len(ids[1])), margin=rng.uniform(-1, 1))
        samples.append(sample)
    model = reward_model()
    model.config.pad_token_id = None  # (as Llama 3's: the tokenizer's, eos, becomes it)
    engine = OdbEngine(LocalBackend(copy.deepcopy(model)), world_size=1, max_tokens=512, pad_token_id=eos,
                       loss_chunk_tokens=None, objective=Reward())
    plan = plan_of([samples[:3], samples[3:]], padded=1)
    tally = engine.tally(plan)
    for micro, micro_samples in zip(plan.micro_batches, [samples[:3], samples[3:], []], strict=True):
        tally.loss(micro, micro_samples).backward()
    result = tally.result(lr=0.0)
    oracle = copy.deepcopy(model)
    oracle.config.pad_token_id = eos
    hf_model(oracle).set_attn_implementation("eager")
    losses, rewards = zip(*(trl_reward_loss(oracle, s, pad_token_id=eos) for s in samples))
    mean = torch.stack(losses).mean()
    mean.backward()
    rewards = torch.stack(rewards)
    assert result.loss_sum / 4 == pytest.approx(float(mean.detach()), rel=1e-5)
    assert result.rewards[0] == pytest.approx(float(rewards[:, 0].sum()), rel=1e-5, abs=1e-5)
    got = {n: p.grad for n, p in engine.backend.module.named_parameters() if p.grad is not None}
    check_equal(got, {n: p.grad for n, p in oracle.named_parameters() if p.grad is not None})


def test_a_models_own_pad_token_is_kept_and_pooled_by():
    """A host's model (with_odb) pads and pools by its own pad_token_id; odb's differs: the model's
    stays, and a sequence ending in odb's pad id is scored at its last token, as the class scores it."""
    model = reward_model()
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=512, pad_token_id=5, loss_chunk_tokens=None,
                       objective=Reward())
    sample = pair(random.Random(4), 0, ref=False)
    sample["input_ids"][sample["pair"][0] - 1] = 5  # the chosen sequence ends in odb's pad id
    with torch.no_grad():
        _, rewards = Reward().pairs(engine, plan_of([[sample]]).micro_batches[0], [sample])
        want = trl_reward_loss(model.eval(), sample, pad_token_id=0)[1]
    assert model.config.pad_token_id == 0
    torch.testing.assert_close(rewards[0], want, rtol=1e-5, atol=1e-5)
