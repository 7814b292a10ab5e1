"""Mixture-of-experts models packed and trained exactly: tiny Qwen3-MoE, Mixtral (sliding window),
OLMoE and gpt-oss (attention sinks, alternating window layers), 4 experts, top-2, 2 layers.

Oracles (STYLE 16), none of them odb's code: the model's own eager attention on each sample
alone; the model's own ``model(labels=..., output_router_logits=True).loss`` (mean token loss +
``router_aux_loss_coef * aux_loss``) and its gradients; the model's own ``aux_loss`` on padded rows
with an attention mask. Tolerances: loss 1e-6 relative, gradients 1e-5 relative to each tensor's
largest entry (fp32; measured ~1e-8 and ~1e-6). The router loss coefficient of the tiny configs
(0.1) is large enough that leaving the router loss out moves the router's gradient far past them.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from test_attention import (
    IMAGE_IDS,
    MOE_FAMILIES,
    TEXT,
    VL_FAMILIES,
    build,
    compare_packed_with_alone,
    pair,
    text_samples,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from conftest import one_step_plan
from odb.batching.cost import count_label_tokens
from odb.data.collate import collate_padded
from odb.telemetry import StepTimes, Telemetry
from odb.training import attention
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model, hf_model
from odb.training.model.moe import router_loss
from odb.training.step.engine import OdbEngine
from odb.training.step.loss import token_loss_sum

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def labelled(samples: list[dict]) -> list[dict]:
    return [{**s, "labels": s["input_ids"]} for s in samples]


def relative_grad_diff(model, oracle) -> tuple[float, str]:
    """The worst of |grad - oracle grad| / max |oracle grad| over the trainable tensors."""
    theirs = dict(oracle.named_parameters())
    worst = (0.0, "")
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        assert (param.grad is None) == (theirs[name].grad is None), name
        if param.grad is not None:
            scale = max(float(theirs[name].grad.abs().max()), 1e-12)
            worst = max(worst, (float((param.grad - theirs[name].grad).abs().max()) / scale, name))
    return worst


def own_loss(oracle, sample: dict, **extra) -> torch.Tensor:
    ids = torch.tensor([sample["input_ids"]])
    return oracle(input_ids=ids, labels=torch.tensor([sample["labels"]]), use_cache=False, **extra).loss


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_packed_row_matches_eager_on_each_sample_alone(family):
    """Six samples (1 to 96 tokens) in one row: logits and gradients; the tokens are routed to
    every expert of every MoE layer (so the test sees every expert's weights)."""
    compare_packed_with_alone(family, text_samples())
    oracle = build(family, "eager")
    per_sample = [oracle(input_ids=torch.tensor([s["input_ids"]]), use_cache=False, output_router_logits=True)
                  for s in text_samples()]
    for layer, logits in enumerate(zip(*(out.router_logits for out in per_sample))):
        chosen = torch.cat(logits).topk(2, dim=-1).indices.unique()
        assert chosen.numel() == 4, f"{family} layer {layer}: only experts {chosen.tolist()} routed to"


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("chunk_tokens", [None, 16], ids=["full logits", "chunked"])
def test_one_sample_step_equals_the_models_own_loss(family, chunk_tokens):
    """One sample, one micro-batch, one rank: the trained objective (token loss / label tokens +
    the router loss added) and every gradient equal ``model(labels=..., output_router_logits=True)``'s."""
    model, oracle = pair(family)
    sample = labelled(text_samples((64,)))[0]
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=128, pad_token_id=0,
                       loss_chunk_tokens=chunk_tokens)
    result = engine.train_step(one_step_plan([[sample]]), [[sample]], lr=0.0)
    trained = result.loss_sum / count_label_tokens(sample["labels"]) + result.aux_loss
    theirs = own_loss(oracle, sample, output_router_logits=True)
    theirs.backward()
    loss_rel = abs(trained - theirs.item()) / theirs.item()
    worst, name = relative_grad_diff(model, oracle)
    print(f"{family} ({'chunked' if chunk_tokens else 'full logits'}): loss {theirs.item():.6f} (router loss "
          f"{result.aux_loss:.2e}), rel diff {loss_rel:.1e}; worst grad rel diff {worst:.1e} ({name})")
    assert loss_rel <= LOSS_RTOL and worst <= GRAD_RTOL
    router = next(n for n, _ in oracle.named_parameters() if re.search(r"mlp\.(gate|router)\.weight$", n))
    with_router = dict(oracle.named_parameters())[router].grad.clone()
    oracle.zero_grad()
    own_loss(oracle, sample).backward()  # the token loss alone: the router loss's share of the gradient
    share = float((with_router - dict(oracle.named_parameters())[router].grad).abs().max() / with_router.abs().max())
    print(f"{family}: the router loss moves {router}'s gradient by {share:.1e} (relative)")
    assert share > 100 * GRAD_RTOL


def test_lora_and_gradient_checkpointing(tmp_path):
    """odb's own model build (LoRA on q/v, activation checkpointing, non-reentrant): the router
    logits recorded in the forward survive the recomputation; gradients of the LoRA weights equal
    the plain model's under its own loss."""
    path = tmp_path / "qwen3_moe.json"
    path.write_text(json.dumps({**TEXT, **MOE_FAMILIES["qwen3_moe"]}))
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    model = build_model(path, seed=0, vocab_size=1000, lora=lora, gradient_checkpointing=True)
    for module in model.modules():  # B = 0 at init would hide LoRA's share of the gradient
        if hasattr(module, "lora_B"):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.1)
    oracle = build_model(path, seed=0, vocab_size=1000, lora=lora)
    oracle.load_state_dict(model.state_dict())
    hf_model(oracle).set_attn_implementation("eager")
    sample = labelled(text_samples((64,)))[0]
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=128, pad_token_id=0)
    result = engine.train_step(one_step_plan([[sample]]), [[sample]], lr=0.0)
    trained = result.loss_sum / count_label_tokens(sample["labels"]) + result.aux_loss
    theirs = own_loss(oracle, sample, output_router_logits=True)
    theirs.backward()
    worst, name = relative_grad_diff(model, oracle)
    loss_rel = abs(trained - theirs.item()) / theirs.item()
    print(f"qwen3_moe LoRA + checkpointing: loss rel diff {loss_rel:.1e}, worst grad rel diff {worst:.1e} ({name})")
    assert loss_rel <= LOSS_RTOL and worst <= GRAD_RTOL


def test_a_step_of_several_micro_batches_and_a_dummy():
    """GAS 3 on one rank: 3 samples packed, a dummy, 1 sample. Oracle: the model's own forward on
    each micro-batch as padded rows (its attention mask keeps padding out of its own aux_loss):
    ``sum CE / N + coef * sum_m aux_m * T_m / T`` (:mod:`odb.training.model.moe`)."""
    model, oracle = pair("qwen3_moe")
    micro_batches = [labelled(text_samples((40, 7, 23))), [], labelled(text_samples((30,), seed=1))]
    plan = one_step_plan(micro_batches)
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=128, pad_token_id=0, loss_chunk_tokens=16)
    result = engine.train_step(plan, micro_batches, lr=0.0)
    coef, total_tokens = oracle.router_aux_loss_coef, sum(map(sum, plan.rank_tokens))
    objective, aux_weighted = 0.0, 0.0
    for micro, samples in zip(plan.micro_batches, micro_batches, strict=True):
        if not samples:
            continue
        batch = collate_padded(samples, pad_token_id=0)
        out = oracle(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                     output_router_logits=True)
        aux_weighted = aux_weighted + out.aux_loss * micro.tokens / total_tokens
        objective = objective + token_loss_sum(out.logits, batch["labels"]) / plan.num_label_tokens
    (objective + coef * aux_weighted).backward()
    worst, name = relative_grad_diff(model, oracle)
    aux_weighted = aux_weighted.item()
    aux_rel = abs(result.aux_sum / total_tokens - aux_weighted) / aux_weighted
    print(f"GAS 3 with a dummy: step router loss {aux_weighted:.6f} (rel diff {aux_rel:.1e}), worst grad "
          f"rel diff {worst:.1e} ({name})")
    assert aux_rel <= LOSS_RTOL and worst <= GRAD_RTOL
    assert abs(result.aux_loss - coef * aux_weighted) <= LOSS_RTOL * result.aux_loss
    # each micro-batch's forward timed (the cost fit's and the measured sync efficiency's)
    assert len(result.forward_seconds) == 3 and all(s > 0 for s in result.forward_seconds)


def test_padded_micro_batches_count_real_tokens_only():
    """The padded layout (micro.padded): padding is not a token of the router loss."""
    model, oracle = pair("mixtral")
    samples = labelled(text_samples((40, 7, 23)))
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=128, pad_token_id=0)
    _, packed_aux = engine.forward_loss(samples, False, router=True)
    _, padded_aux = engine.forward_loss(samples, True, router=True)
    batch = collate_padded(samples, pad_token_id=0)
    out = oracle(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True,
                 use_cache=False)
    own, with_padding = out.aux_loss, engine.router_loss.load_balancing(out.router_logits, 4, 2, None)
    print(f"router loss: packed {packed_aux.item():.6f}, padded {padded_aux.item():.6f}, the model's own "
          f"{own.item():.6f}, padding counted {with_padding.item():.6f}")
    for got in (packed_aux, padded_aux):
        assert abs(got.item() - own.item()) <= LOSS_RTOL * own.item()
    assert abs(with_padding.item() - own.item()) > 100 * LOSS_RTOL * own.item()


def qwen3_vl_moe(implementation: str, state: dict | None = None):
    spec = VL_FAMILIES["qwen3_vl"]
    text = {**spec["text_config"], "model_type": "qwen3_vl_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "router_aux_loss_coef": 0.1}
    config = AutoConfig.for_model(model_type="qwen3_vl_moe", text_config=text,
                                  vision_config={**spec["vision_config"], "model_type": "qwen3_vl_moe"}, **IMAGE_IDS)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def test_the_blank_image_of_a_text_only_vl_micro_batch_is_not_routed_into_the_loss():
    """Qwen3-VL-MoE: a micro-batch without images carries a blank image (odb/training/step/engine.py);
    its router loss is the model's own on the text sample alone (counting the blank image's 3 tokens
    would move it)."""
    model = qwen3_vl_moe(attention.register())
    oracle = qwen3_vl_moe("eager", model.state_dict())
    backend = LocalBackend(model)
    engine = OdbEngine(backend, world_size=1, max_tokens=128, pad_token_id=0)
    sample = labelled(text_samples((30,)))[0]
    _, aux = engine.forward_loss([sample], False, router=True)
    with_blank = engine.router_loss.load_balancing(backend.last.router_logits, 4, 2, None)
    own = oracle(input_ids=torch.tensor([sample["input_ids"]]), use_cache=False, output_router_logits=True,
                 mm_token_type_ids=torch.zeros(1, 30, dtype=torch.int)).aux_loss
    print(f"qwen3_vl_moe text-only micro-batch: router loss {aux.item():.6f}, the model's own alone {own.item():.6f}, "
          f"the blank image counted {with_blank.item():.6f}")
    assert abs(aux.item() - own.item()) <= LOSS_RTOL * own.item()
    assert abs(with_blank.item() - own.item()) > 100 * LOSS_RTOL * own.item()


def test_models_without_a_router_loss():
    """Dense models, and DeepSeek-V3 (balanced by a routing bias: no router loss in transformers)."""
    dense = build("llama", attention.register())
    deepseek = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{
        **TEXT, "model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "rope_interleave": False, "head_dim": 8,
        "first_k_dense_replace": 0}), attn_implementation=attention.register())
    assert router_loss(dense) is None and router_loss(deepseek) is None
    sample = labelled(text_samples((20,)))[0]
    result = OdbEngine(LocalBackend(deepseek), world_size=1, max_tokens=64, pad_token_id=0).train_step(
        one_step_plan([[sample]]), [[sample]], lr=0.0)
    assert result.aux_sum is None and result.aux_loss == 0.0 and result.loss_sum > 0


def test_the_metrics_row_carries_the_steps_router_loss(tmp_path):
    """Two ranks' reports: ``aux_loss`` = (sum over ranks of router loss x real tokens) / the step's
    real tokens; a dense model's rows have no ``aux_loss``."""
    sample = labelled(text_samples((10,)))[0]
    plan = one_step_plan([[sample]])._replace(rank_tokens=((10, 30),))
    times = StepTimes(wait=0.0, plan=0.0, collective=0.0, step=1.0, ended=0.0)
    for aux_sums, expected in (((2.0 * 10, 3.0 * 30), {"aux_loss": 2.75}), ((None, None), {})):
        ranks = [Telemetry(rank=r, max_steps_per_round=2, max_tokens=64, dataset_size=1, output_dir=tmp_path)
                 for r in range(2)]
        reports = []
        for telemetry, aux_sum in zip(ranks, aux_sums, strict=True):
            telemetry.record(plan, loss_sum=1.0, lr=0.0, times=times, aux_sum=aux_sum)
            reports.append(telemetry.report({}))
        row, = ranks[0].on_reports(np.stack(reports))
        assert {k: row[k] for k in row if k == "aux_loss"} == expected
        for telemetry in ranks:
            telemetry.close()
