"""Preference objectives over packed pairs (odb.training.step.preference) against independent
oracles: each sequence alone through an eager copy of the model (its own logits, log-softmax
summed over the answer's labels), then TRL's own loss code (CPOTrainer.cpo_loss for sigmoid, IPO,
hinge and SimPO, ORPOTrainer.odds_ratio_loss for ORPO's odds ratio), the mean over the pairs;
the packed step's loss and every gradient must equal the oracle's. References: from the data
(random log-probs) and from a LoRA model's base (the adapter disabled). The oracle's pieces are
tests/preference_oracle.py's (the two-rank test, tests/e2e/test_preference_ranks.py, uses them too)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from odb.batching.cost import SampleCost, count_label_tokens
from odb.batching.plan import MicroBatch, StepPlan
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model, hf_model
from odb.training.step.engine import OdbEngine
from odb.training.step.preference import Preference, pair_losses
from preference_oracle import alone_logps, answer_tokens, pair, trl_loss

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024


def cost(sample: dict) -> SampleCost:
    return SampleCost(sample["uid"], len(sample["input_ids"]), count_label_tokens(sample["labels"].tolist()), 0, 0)


def plan_of(micro_samples: list[list[dict]], padded: int = -1) -> StepPlan:
    micro = [MicroBatch(tuple(cost(s) for s in samples), padded=i == padded) for i, samples in enumerate(micro_samples)]
    return StepPlan(epoch=0, step=0, micro_batches=(*micro, MicroBatch(())),
                    num_label_tokens=sum(m.label_tokens for m in micro),
                    num_samples=sum(map(len, micro_samples)), rank_costs=(), rank_tokens=())


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


def test_the_reference_leaves_the_adapter_trainable_where_its_module_swaps_parameters():
    """FSDP2 swaps a unit's parameters for gathered copies in its forward, and the root unit (the
    LM head's) keeps them until the backward; PEFT's disable_adapter turns the adapter's
    requires_grad on again on the copies only. Simulated: the model's first call swaps every
    parameter for a copy with its flag at the time, kept through the micro-batch, the originals
    put back after. Every trainable parameter must still be trainable (regression: the LoRA weights
    stayed frozen under FSDP2, and so would be left out of checkpoints as frozen)."""
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"], "lora_dropout": 0.0}
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=VOCAB, lora=lora)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def gather(module, args, kwargs):
        if swapped:
            return
        for name, p in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            holder = model.get_submodule(owner)
            holder._parameters[leaf] = torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            swapped.append((holder, leaf, p))

    handle = model.register_forward_pre_hook(gather, with_kwargs=True)
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=512, pad_token_id=0, loss_chunk_tokens=64,
                       objective=Preference("dpo"))
    samples = [pair(random.Random(2), 0, ref=False)]
    Preference("dpo").pairs(engine, plan_of([samples]).micro_batches[0], samples)
    handle.remove()
    for holder, leaf, p in swapped:  # resharded after the backward
        holder._parameters[leaf] = p
    assert swapped and {name for name, p in model.named_parameters() if p.requires_grad} == trainable


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


@pytest.mark.parametrize("mean_chosen", [0.0, -1e-8, -3e-8])
def test_orpo_has_finite_gradients_where_the_chosen_answer_is_certain(mean_chosen):
    # every chosen label token's fp32 cross entropy 0 (its logit leads by ~17): a_c = 0, or a few
    # 1e-8 above; log(1 - e^a) was -inf there, or its unused branch's backward 0 x inf: NaN gradients
    pi = torch.tensor([[mean_chosen * 4, -8.0]], requires_grad=True)
    n = torch.tensor([[4.0, 4.0]])
    loss, _ = pair_losses("orpo", pi, None, n, beta=0.1)
    loss.sum().backward()
    assert torch.isfinite(pi.grad).all(), pi.grad
    if mean_chosen:  # the value is TRL's in float64 (finite there but at 0) to within beta * 1e-6
        pi64 = pi.detach().double()[0]
        want = trl_loss("orpo", 0.1, 0.5, [pi64[0], pi64[1]], None, [4.0, 4.0])
        torch.testing.assert_close(loss.double()[0], want, rtol=0, atol=1e-6)


def test_the_preflight_probe_of_a_lora_dpo_run_runs_the_reference_forward_first():
    """The preflight measures a pair micro-batch's model calls: the reference's (the adapter
    disabled, no gradients), then the policy's with its backward; a reference-free loss the policy's alone."""
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=VOCAB,
                        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0})
    calls: list[tuple[bool, bool]] = []  # (gradients on, the adapter on)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    handle = layer.register_forward_hook(
        lambda m, a, o: calls.append((torch.is_grad_enabled(), not m.disable_adapters)))
    samples = [{"input_ids": torch.arange(3, 40), "labels": torch.arange(3, 40)}]
    for objective, want in ((Preference("dpo"), [(False, False), (True, True)]),
                            (Preference("simpo", reference="none"), [(True, True)])):
        calls.clear()
        engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=64, pad_token_id=0, loss_chunk_tokens=16,
                           objective=objective)
        engine.probe_step(samples)
        assert calls == want, objective.loss
    handle.remove()
