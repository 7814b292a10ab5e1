"""Preference objectives over packed pairs (odb.training.step.preference) against independent
oracles: each sequence alone through an eager copy of the model (its own logits, log-softmax
summed over the answer's labels), then TRL's own loss code (CPOTrainer.cpo_loss for sigmoid, IPO,
hinge and SimPO, ORPOTrainer.odds_ratio_loss for ORPO's odds ratio), the mean over the pairs;
the packed step's loss and every gradient must equal the oracle's. References: from the data
(random log-probs) and from a LoRA model's base (the adapter disabled)."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from odb.batching.cost import SampleCost, count_label_tokens
from odb.batching.plan import MicroBatch, StepPlan
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model, hf_model
from odb.training.step.engine import OdbEngine
from odb.training.step.preference import Preference

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024


def pair(rng: random.Random, uid: int, *, ref: bool) -> dict:
    """A pair sample as odb.data.preference makes one: chosen then rejected, each prompt + answer,
    labels on the answer; lengths very uneven."""
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]
    seqs = []
    for _ in range(2):
        answer = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 3, 9, 40]))]
        seqs.append((prompt + answer, [-100] * len(prompt) + answer))
    sample = {"uid": uid, "index": uid, "source": 0, "input_ids": torch.tensor(seqs[0][0] + seqs[1][0]),
              "labels": torch.tensor(seqs[0][1] + seqs[1][1]), "pair": (len(seqs[0][0]), len(seqs[1][0]))}
    if ref:
        sample["ref_logps"] = (-rng.uniform(5, 200), -rng.uniform(5, 200))
    return sample


def cost(sample: dict) -> SampleCost:
    return SampleCost(sample["uid"], len(sample["input_ids"]), count_label_tokens(sample["labels"].tolist()), 0, 0)


def plan_of(micro_samples: list[list[dict]], padded: int = -1) -> StepPlan:
    micro = [MicroBatch(tuple(cost(s) for s in samples), padded=i == padded) for i, samples in enumerate(micro_samples)]
    return StepPlan(epoch=0, step=0, micro_batches=(*micro, MicroBatch(())),
                    num_label_tokens=sum(m.label_tokens for m in micro),
                    num_samples=sum(map(len, micro_samples)), rank_costs=(), rank_tokens=())


def alone_logps(model, sample: dict) -> list[torch.Tensor]:
    """The oracle's log-probabilities of a pair's two sequences, each alone (eager attention)."""
    chosen = sample["pair"][0]
    out = []
    for ids, labels in ((sample["input_ids"][:chosen], sample["labels"][:chosen]),
                        (sample["input_ids"][chosen:], sample["labels"][chosen:])):
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        targets = labels[1:]
        scored = targets != -100
        out.append(torch.log_softmax(logits, -1)[scored].gather(1, targets[scored][:, None]).sum())
    return out


def answer_tokens(sample: dict) -> list[int]:
    chosen = sample["pair"][0]
    labels = sample["labels"].tolist()
    return [count_label_tokens(labels[:chosen]), count_label_tokens(labels[chosen:])]


def trl_loss(loss: str, beta: float, gamma: float, pi, rho, n) -> torch.Tensor:
    """TRL's own loss of one pair from its log-probabilities."""
    trainer = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=0.0, simpo_gamma=gamma,
                              accelerator=SimpleNamespace(device="cpu"))
    if loss == "orpo":
        mean = [pi[0] / n[0], pi[1] / n[1]]
        ratio = ORPOTrainer.odds_ratio_loss(trainer, mean[0][None], mean[1][None])[0]
        return -mean[0] - ratio[0]  # ORPO: the chosen answer's mean NLL minus beta log sigmoid(log odds)
    trainer.loss_type = {"dpo": "sigmoid", "ipo": "ipo", "hinge": "hinge", "simpo": "simpo"}[loss]
    if loss == "simpo":
        chosen, rejected = pi[0] / n[0], pi[1] / n[1]
    elif loss == "ipo":  # TRL's DPO IPO: the log ratios per answer token
        chosen, rejected = (pi[0] - rho[0]) / n[0], (pi[1] - rho[1]) / n[1]
    else:
        chosen, rejected = pi[0] - rho[0], pi[1] - rho[1]
    return CPOTrainer.cpo_loss(trainer, chosen[None], rejected[None])[0][0]


def oracle(model, micro_samples, loss: str, beta: float, gamma: float, reference) -> tuple[float, dict]:
    """The mean of TRL's per-pair losses on each sequence alone, and its gradients."""
    model.zero_grad()
    samples = [s for micro in micro_samples for s in micro]
    total = 0
    for sample in samples:
        pi = alone_logps(model, sample)
        rho = reference(sample)
        total = total + trl_loss(loss, beta, gamma, pi, rho, answer_tokens(sample))
    mean = total / len(samples)
    mean.backward()
    return float(mean), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed(model, micro_samples, objective: Preference, padded: int = -1) -> tuple[float, dict, object]:
    model.zero_grad()
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=512, pad_token_id=0, loss_chunk_tokens=64,
                       objective=objective)
    plan = plan_of(micro_samples, padded)
    tally = engine.tally(plan)
    for micro, samples in zip(plan.micro_batches, [*micro_samples, []], strict=True):
        tally.loss(micro, samples).backward()
    result = tally.result(lr=0.0)
    return (result.loss_sum / plan.num_samples,
            {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, result)


def check_equal(got, want, *, rtol=1e-4, atol=1e-5):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def tiny():
    return build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=VOCAB)


def eager(model):
    copied = copy.deepcopy(model)
    hf_model(copied).set_attn_implementation("eager")
    return copied


@pytest.mark.parametrize("loss", ["dpo", "ipo", "hinge", "simpo", "orpo"])
def test_packed_pairs_train_trls_loss_of_each_pair_alone(tiny, loss):
    """Three micro-batches of 3, 2 and 1 pairs (one padded), a dummy: the step's loss and every
    gradient against the oracle's; beta large enough that hinge is not flat."""
    rng = random.Random(len(loss))
    reference = "none" if loss in ("simpo", "orpo") else "data"
    samples = [pair(rng, uid, ref=reference == "data") for uid in range(6)]
    micro_samples = [samples[:3], samples[3:5], samples[5:]]
    beta, gamma = (0.01 if loss == "hinge" else 0.5), 0.3
    objective = Preference(loss, beta=beta, gamma=gamma, reference=reference)
    got_loss, got_grads, result = packed(copy.deepcopy(tiny), micro_samples, objective, padded=1)
    refs = (lambda s: [torch.tensor(v) for v in s["ref_logps"]]) if reference == "data" else (lambda s: None)
    want_loss, want_grads = oracle(eager(tiny), micro_samples, loss, beta, gamma, refs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    check_equal(got_grads, want_grads)
    chosen, rejected, right = result.rewards
    assert 0 <= right <= 6 and chosen != rejected


def test_the_reference_of_a_lora_run_is_its_base_model(tiny):
    """LoRA, adapter weights moved off their zero init so that policy and base differ: the
    reference is the base model (the adapter disabled), the gradient only the adapter's."""
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=VOCAB,
                        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    rng = random.Random(7)
    samples = [pair(rng, uid, ref=False) for uid in range(4)]
    micro_samples = [samples[:2], samples[2:]]
    got_loss, got_grads, _ = packed(copy.deepcopy(model), micro_samples, Preference("dpo", beta=0.5))
    base = eager(model)

    def reference(sample):
        with torch.no_grad(), base.disable_adapter():
            return alone_logps(base, sample)

    want_loss, want_grads = oracle(base, micro_samples, "dpo", 0.5, 0.5, reference)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got_grads and all("lora_" in name for name in got_grads)
    check_equal(got_grads, want_grads)
    assert abs(want_loss - 0.6931) > 1e-3  # the policy is not its reference (loss log 2 at equality)


def test_a_full_fine_tune_has_no_adapter_to_disable(tiny):
    rng = random.Random(1)
    with pytest.raises(ValueError, match="needs a LoRA run"):
        packed(copy.deepcopy(tiny), [[pair(rng, 0, ref=False)]], Preference("dpo"))


@pytest.mark.parametrize("kwargs,match", [({"loss": "kto"}, "one of"), ({"loss": "simpo", "reference": "data"},
                                          "reference free"), ({"loss": "dpo", "reference": "none"}, "against a"),
                                         ({"beta": 0.0}, "beta")])
def test_settings_that_cannot_hold_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Preference(**kwargs)


def test_the_evaluation_of_pairs_is_the_mean_pair_loss_and_the_rewards_over_every_pair(tiny, tmp_path):
    """The bundled preference records through the Evaluator (max_tokens small enough that some pairs
    are over the cap, scored whole after the packed pass) against TRL's SimPO loss of each pair alone."""
    from conftest import bundled_tokenizer
    from odb.batching.align import SimulatedGroup
    from odb.batching.config import OdbConfig
    from odb.data.processing import SampleDataset
    from odb.training.run.evaluate import Evaluator

    dataset = SampleDataset(ROOT / "data" / "preference.jsonl", bundled_tokenizer(), pairs=True,
                            cache_dir=tmp_path)
    model = copy.deepcopy(tiny)
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=400, pad_token_id=0, loss_chunk_tokens=64,
                       objective=Preference("simpo", beta=2.0, gamma=0.5, reference="none"))
    result = Evaluator(engine, dataset, OdbConfig(max_tokens=400, window=8, cost_model="manual"),
                       SimulatedGroup(1).communicator(0)).run()
    oracle_model = eager(tiny).eval()
    losses, right, margins = [], 0, []
    with torch.no_grad():
        for i in range(len(dataset)):
            sample = dataset[i]
            pi, n = alone_logps(oracle_model, sample), answer_tokens(sample)
            losses.append(float(trl_loss("simpo", 2.0, 0.5, pi, None, n)))
            chosen, rejected = 2.0 * pi[0] / n[0], 2.0 * pi[1] / n[1]
            right += bool(chosen > rejected)
            margins.append(float(chosen - rejected))
    print(f"eval {result.loss:.6f} over {result.samples} pairs ({result.over_cap} over the cap), {result.rewards}")
    assert result.samples == len(dataset) and result.over_cap > 0
    assert result.loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert result.rewards["accuracies"] == right / len(dataset)
    assert result.rewards["margins"] == pytest.approx(sum(margins) / len(margins), rel=1e-4, abs=1e-6)
