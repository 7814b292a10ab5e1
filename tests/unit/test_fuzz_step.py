"""A whole step's loss math, fuzzed (I4): W simulated ranks in one process, random GAS, random
micro-batches (packed or padded rows, dummies), random sample lengths (1 token included), random
label masks (prompt-only samples, samples with 0 or 1 label token, random -100 runs), samples over
``max_tokens`` (the engine cuts them), random sources, the loss in chunks (1 token a chunk, chunks
that do and do not divide, one larger than the row) or from full logits, LoRA (on the head too),
activation checkpointing.

The oracle shares none of odb's collate, positions, attention or loss: the model's own eager
attention and own ``labels=`` loss on each sample alone (cut to ``max_tokens`` as a truncating run
trains it), times its label count, summed over every sample of every rank and divided by the label
tokens counted here from the samples' own labels. Checked:

* each rank's ``loss_sum``, ``label_tokens`` and per-source sums against the oracle's, on that rank;
* the step's gradient: both backends average over the W ranks, so the mean over ranks of what each
  rank's micro-batches back (``OdbEngine.train_step`` on a :class:`LocalBackend`: the gradients
  add up in ``.grad``) equals ``grad(sum of token losses / N_step)``, to 1e-5 of each tensor's
  largest entry, or of 5% of the step's largest entry where that is more (fp32 round-off, measured
  beside the check).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import TEXT, TEXT_FAMILIES
from transformers import AutoConfig, AutoModelForCausalLM

from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, StepPlan
from odb.training import attention
from odb.training.backends import LocalBackend
from odb.training.model.build import hf_model
from odb.training.step.engine import OdbEngine

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5
STEP_FLOOR = 0.05  # a small tensor's gradient is checked to GRAD_RTOL of 5% of the step's largest entry
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SOFTCAP = 30.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def base_state(family: str) -> dict[str, torch.Tensor]:
    return _new(family, attention.register()).state_dict()


def _new(family: str, implementation: str):
    overrides = {"final_logit_softcapping": SOFTCAP} if family == "gemma2" else {}
    config = AutoConfig.for_model(**{**TEXT, **TEXT_FAMILIES[family], **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).train()


def models(family: str, lora: bool, checkpointing: bool = False):
    """odb's model (odb_varlen) and the oracle (eager, no recomputation), the same weights (LoRA: B
    random too); ``checkpointing``: odb's recomputes every decoder layer in the backward, as
    ``--gradient_checkpointing`` builds it."""
    model = _new(family, attention.register())
    model.load_state_dict(base_state(family))
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj", "down_proj", "lm_head"]))
    oracle = copy.deepcopy(model)
    hf_model(oracle).set_attn_implementation("eager")
    if checkpointing:
        from odb.training.model.build import _checkpoint_activations

        _checkpoint_activations(model.get_base_model() if lora else model)
    return model, oracle


def labels_of(draw, ids: list[int]) -> list[int]:
    kind = draw(st.sampled_from(["all", "prompt", "none", "one", "random"]))
    n = len(ids)
    if kind == "all":
        return list(ids)
    if kind == "none":  # a prompt-only sample: nothing to train
        return [-100] * n
    if kind == "one":  # exactly one label that counts (a first-position label never does)
        at = draw(st.integers(0, n - 1))
        return [ids[i] if i == at else -100 for i in range(n)]
    if kind == "prompt":
        k = draw(st.integers(0, n))
        return [-100] * k + ids[k:]
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return [i if keep else -100 for i, keep in zip(ids, mask, strict=True)]


@st.composite
def steps(draw):
    """A step over ``world`` ranks: per rank ``gas`` micro-batches, each a dummy or 1-4 samples."""
    world, gas = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    max_tokens = draw(st.integers(12, 48))
    ranks = []
    for _ in range(world):
        micro_batches = []
        for _ in range(gas):
            if draw(st.integers(0, 4)) == 0:
                micro_batches.append(([], False))
                continue
            lengths = draw(st.lists(st.integers(1, max_tokens + 12), min_size=1, max_size=4))
            samples = []
            for n in lengths:
                ids = draw(st.lists(st.integers(10, 999), min_size=n, max_size=n))
                samples.append({"input_ids": ids, "labels": labels_of(draw, ids), "source": draw(st.integers(0, 2))})
            micro_batches.append((samples, draw(st.integers(0, 3)) == 0))  # a quarter as padded rows
        ranks.append(micro_batches)
    return {"family": draw(st.sampled_from(sorted(TEXT_FAMILIES))), "ranks": ranks, "max_tokens": max_tokens,
            "chunk_tokens": draw(st.sampled_from([None, 1, 5, 16, 4096])), "lora": draw(st.integers(0, 3)) == 0,
            "checkpointing": draw(st.integers(0, 3)) == 0}


def kept(sample: dict, max_tokens: int) -> dict:
    """The sample as a truncating run trains it: its first ``max_tokens`` tokens."""
    return {**sample, "input_ids": sample["input_ids"][:max_tokens], "labels": sample["labels"][:max_tokens]}


def counted(sample: dict) -> int:
    """Label tokens of a sample alone: positions 1.. whose label is not -100 (the model shifts)."""
    return sum(1 for label in sample["labels"][1:] if label != -100)


def own_loss_sum(oracle, sample: dict) -> torch.Tensor:
    count = counted(sample)
    if not count:
        return torch.zeros(())
    out = oracle(input_ids=torch.tensor([sample["input_ids"]]), labels=torch.tensor([sample["labels"]]),
                 use_cache=False)
    return out.loss * count


def plans(ranks, max_tokens: int) -> list[StepPlan]:
    """Each rank's step as the batcher plans it: the step's label tokens over every rank."""
    micro = [[MicroBatch(tuple(SampleCost(uid=i, tokens=len(kept(s, max_tokens)["input_ids"]), patches=0, cost=0,
                                          label_tokens=counted(kept(s, max_tokens))) for i, s in enumerate(samples)),
                         padded=padded and bool(samples)) for samples, padded in rank] for rank in ranks]
    total = sum(m.label_tokens for rank in micro for m in rank)
    tokens = tuple(tuple(rank[m].tokens for rank in micro) for m in range(len(micro[0])))
    return [StepPlan(epoch=0, step=0, micro_batches=tuple(rank), num_label_tokens=total,
                     num_samples=sum(len(m.samples) for m in rank), rank_costs=tokens, rank_tokens=tokens)
            for rank in micro]


def grads(model) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for name, p in model.named_parameters() if p.requires_grad}


@FUZZ
@given(steps())
def test_a_fuzzed_step_equals_its_samples_alone_over_the_steps_label_tokens(case):
    ranks, max_tokens, world = case["ranks"], case["max_tokens"], len(case["ranks"])
    model, oracle = models(case["family"], case["lora"], case["checkpointing"])
    step_plans = plans(ranks, max_tokens)
    n_step = step_plans[0].num_label_tokens
    expected_total = torch.zeros(())
    for r, (rank, plan) in enumerate(zip(ranks, step_plans, strict=True)):
        engine = OdbEngine(LocalBackend(model), world_size=world, max_tokens=max_tokens, pad_token_id=0,
                           loss_chunk_tokens=case["chunk_tokens"])
        result = engine.train_step(plan, [samples for samples, _ in rank], lr=0.0)
        mine = [kept(s, max_tokens) for samples, _ in rank for s in samples]
        by_source = [torch.zeros(()) for _ in range(3)]
        for sample in mine:
            own = own_loss_sum(oracle, sample)
            by_source[sample["source"]] = by_source[sample["source"]] + own.detach()
            expected_total = expected_total + own
        expected = float(sum(by_source))
        assert abs(result.loss_sum - expected) <= LOSS_RTOL * max(expected, 1.0), (r, result.loss_sum, expected)
        assert result.label_tokens == sum(counted(s) for s in mine)
        for source, want in enumerate(by_source):
            got = result.source_loss[source] if source < len(result.source_loss) else 0.0
            assert abs(got - float(want)) <= LOSS_RTOL * max(float(want), 1.0), (r, source, got, float(want))
    if n_step:
        (expected_total / n_step).backward()
    mine, theirs = grads(model), grads(oracle)
    step_max = max(float(g.abs().max()) for g in theirs.values())
    for name, grad in mine.items():
        want = theirs[name]
        # fp32 round-off is set by the step's gradients, not by one small tensor's: the floor is
        # STEP_FLOOR of the step's largest entry (and 1e-2, for a gradient 0 in exact maths). Measured
        # on gemma2 (LoRA, chunked head loss, the one scored token of a 48-token row): layer 1's
        # q_proj lora_A gradient peaks at 6.2e-3 (the step's largest: 4.2), and odb and the oracle
        # differ by 3.7e-7 in fp32 but 1.0e-16 in fp64 (both sides; softmax, CE and RMSNorm kept
        # in fp64); against fp64 the oracle alone is off by 4.5e-7, odb by 8.2e-7 (a 1e-7 bound
        # failed the oracle itself). Over the 60 examples the fp32 gap stays under 1.7e-6 of the
        # step's largest entry, and the fp64 gap under 3e-14 of a tensor's own.
        scale = max(float(want.abs().max()), STEP_FLOOR * step_max, 1e-2)
        diff = float((grad / world - want).abs().max())
        assert diff <= GRAD_RTOL * scale, f"{case['family']}: gradient of {name} off by {diff:.2e} (scale {scale:.2e})"
