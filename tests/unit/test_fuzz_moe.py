"""A mixture-of-experts step, fuzzed: the router loss under packing (odb/training/model/moe.py).

W simulated ranks in one process, random GAS, random micro-batches (packed or padded rows,
dummies), random lengths and label masks (prompt-only samples, one label), samples cut at
``max_tokens``, the loss in chunks or from full logits; tiny Qwen3-MoE, Mixtral, OLMoE and gpt-oss
(4 experts, top-2, coefficient 0.1). What odb documents it trains (docs/design.md, loss math)::

    sum CE / N_step  +  coef * sum_{r,m} aux_{r,m} * T_{r,m} / T_s

with ``aux_{r,m}`` the model's own router loss over micro-batch m's real tokens. The oracle is the
model's own code with none of odb's: its eager attention and own ``labels=`` loss on each sample
alone for the token loss, and its own ``aux_loss`` on each micro-batch as right-padded rows with
an attention mask (which keeps the padding out of its router statistics) for the router loss.
Checked: each rank's reported loss and router sums, the step's ``aux_loss``, and the mean over
ranks of the gradients against the oracle's gradient (1e-5 of each tensor's largest entry).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import MOE_FAMILIES, pair
from test_fuzz_step import counted, grads, kept, labels_of, own_loss_sum, plans

from odb.data.collate import collate_padded
from odb.training.backends import LocalBackend
from odb.training.step.engine import OdbEngine

LOSS_RTOL, GRAD_RTOL = 1e-5, 3e-5  # (gradients: measured up to 1.04e-5, gpt-oss through the router)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def steps(draw):
    world, gas = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    max_tokens = draw(st.integers(8, 40))
    ranks = []
    for _ in range(world):
        micro_batches = []
        for _ in range(gas):
            if draw(st.integers(0, 4)) == 0:
                micro_batches.append(([], False))
                continue
            samples = []
            for n in draw(st.lists(st.integers(1, max_tokens + 8), min_size=1, max_size=3)):
                ids = draw(st.lists(st.integers(10, 999), min_size=n, max_size=n))
                samples.append({"input_ids": ids, "labels": labels_of(draw, ids)})
            micro_batches.append((samples, draw(st.integers(0, 3)) == 0))
        ranks.append(micro_batches)
    return {"family": draw(st.sampled_from(sorted(MOE_FAMILIES))), "ranks": ranks, "max_tokens": max_tokens,
            "chunk_tokens": draw(st.sampled_from([None, 3, 1024]))}


def own_aux(oracle, samples: list[dict]) -> torch.Tensor:
    """The model's own router loss of one micro-batch: its samples as padded rows, masked."""
    batch = collate_padded(samples, pad_token_id=0)
    out = oracle(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                 output_router_logits=True)
    return out.aux_loss


@FUZZ
@given(steps())
def test_a_fuzzed_moe_step_trains_the_token_loss_and_the_token_weighted_router_loss(case):
    ranks, max_tokens, world = case["ranks"], case["max_tokens"], len(case["ranks"])
    model, oracle = pair(case["family"])
    coef = float(oracle.config.router_aux_loss_coef)
    step_plans = plans(ranks, max_tokens)
    n_step = step_plans[0].num_label_tokens
    t_step = sum(map(sum, step_plans[0].rank_tokens))
    objective, aux_total, reported = torch.zeros(()), 0.0, 0.0
    for r, (rank, plan) in enumerate(zip(ranks, step_plans, strict=True)):
        engine = OdbEngine(LocalBackend(model), world_size=world, max_tokens=max_tokens, pad_token_id=0,
                           loss_chunk_tokens=case["chunk_tokens"])
        result = engine.train_step(plan, [samples for samples, _ in rank], lr=0.0)
        token_loss, aux_sum = 0.0, 0.0
        for (samples, _), micro in zip(rank, plan.micro_batches, strict=True):
            if not samples:
                continue
            cut = [kept(s, max_tokens) for s in samples]
            for sample in cut:
                own = own_loss_sum(oracle, sample)
                token_loss += float(own.detach())
                if n_step:
                    objective = objective + own / n_step
            aux = own_aux(oracle, cut)
            aux_sum += float(aux.detach()) * micro.tokens
            objective = objective + coef * aux * micro.tokens / t_step
        aux_total += aux_sum
        reported += result.aux_loss  # (this rank's share of coef x the step's aux_loss)
        assert abs(result.loss_sum - token_loss) <= LOSS_RTOL * max(token_loss, 1.0), (r, result.loss_sum, token_loss)
        assert result.label_tokens == sum(counted(kept(s, max_tokens)) for samples, _ in rank for s in samples)
        assert result.aux_sum == pytest.approx(aux_sum, rel=LOSS_RTOL, abs=1e-6), r
    if t_step:
        assert reported == pytest.approx(coef * aux_total / t_step, rel=LOSS_RTOL, abs=1e-7)
    if objective.requires_grad:
        objective.backward()
    mine, theirs = grads(model), grads(oracle)
    for name, grad in mine.items():
        want = theirs[name]
        scale = max(float(want.abs().max()), 1e-2)  # (abs 1e-7: rounding, where a gradient is 0 in exact maths)
        diff = float((grad / world - want).abs().max())
        assert diff <= GRAD_RTOL * scale, f"{case['family']}: gradient of {name} off by {diff:.2e} (scale {scale:.2e})"
