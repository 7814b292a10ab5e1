"""Which models odb refuses to pack (odb/training/model/capability.py), on skeletons of transformers' own
default configs (the ``meta`` device: no weights, seconds), and the engine's backstop: a model whose
attention never calls odb's stops at its first forward instead of training across samples.

What makes a refusal right is measured elsewhere: tests/unit/test_check_model.py shows a refused
family (LFM2's convolutions) leaking across packed samples once the refusal is switched off; a
review measured the families below the same way (packed against alone, max logit difference
0.35-0.62 for bailing-hybrid, ZAYA, Kimi-Linear's delta layers and xLSTM; 0.02-0.54 for BLOOM,
MPT and XGLM, whose attention ignores odb's)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from conftest import ROOT, bundled_tokenizer
from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, StepPlan
from odb.training.attention.varlen import register
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model
from odb.training.model.capability import packing_refusal
from odb.training.model.mrope import supports_packing
from odb.training.step.engine import OdbEngine

REFUSED = {  # model type: what the refusal names
    "bloom": "not through transformers' attention interface",
    "mpt": "not through transformers' attention interface",
    "xglm": "not through transformers' attention interface",
    "bailing_hybrid": "BailingHybridDeltaAttention",
    "kimi_linear": "KimiLinearDeltaAttention",
    "zaya": "ZayaCCAProjection",
    "xlstm": "xLSTMLayer",
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5": "Qwen3_5GatedDeltaNet",
    "jamba": "JambaMambaMixer",
    "mamba": "MambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "minimax": "MiniMaxLightningAttention",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock",
}
PACKED = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "olmo2", "granite", "glm4", "qwen3_moe", "mixtral",
          "olmoe", "gpt_oss", "deepseek_v3"]


def skeleton_of(model_type: str, **overrides):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**overrides))


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_models_that_mix_tokens_outside_odb_s_attention_are_refused_naming_why(model_type):
    reason = packing_refusal(skeleton_of(model_type))
    assert reason is not None and REFUSED[model_type] in reason, reason


@pytest.mark.parametrize("model_type", PACKED)
def test_attention_only_models_pack(model_type):
    assert packing_refusal(skeleton_of(model_type)) is None


def test_kimi_linear_s_full_attention_layers_alone_are_not_named_as_linear():
    """``KimiLinearAttention`` is Kimi-Linear's full (MLA) attention: not a token mixer to name (the
    model is refused for its delta layers, and its attention's own code, not for that class)."""
    reason = packing_refusal(skeleton_of("kimi_linear"))
    assert "KimiLinearAttention'" not in reason


def test_the_engine_stops_a_model_whose_attention_never_calls_odb_s_at_its_first_forward():
    """BLOOM accepts attn_implementation='odb_varlen' and ignores it: without the start-up refusal it
    would train packed rows with attention across samples. The engine's first forward says so."""
    tokenizer = bundled_tokenizer()
    config = AutoConfig.for_model("bloom", vocab_size=len(tokenizer), hidden_size=32, n_layer=1, n_head=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register())
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=64, pad_token_id=0)
    samples = [{"input_ids": torch.arange(10, 20), "labels": torch.arange(10, 20)} for _ in range(2)]
    micro = MicroBatch(tuple(SampleCost(uid=i, tokens=10, label_tokens=9, patches=0, cost=10) for i in range(2)))
    plan = StepPlan(epoch=0, step=0, micro_batches=(micro,), num_label_tokens=18, num_samples=2,
                    rank_costs=((20,),), rank_tokens=((20,),))
    with pytest.raises(ValueError, match="BloomForCausalLM never called odb's attention"):
        engine.train_step(plan, [samples], lr=0.0)


def test_a_model_left_on_another_attention_is_stopped_naming_odbs():
    """A host's own model (HostRun: any model) loaded with transformers' default SDPA never calls
    odb's attention: the first forward stops it naming the attention to set, not as a model odb
    cannot train."""
    config = AutoConfig.for_model("llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=64, pad_token_id=0)
    samples = [{"input_ids": torch.arange(10, 20), "labels": torch.arange(10, 20)}]
    with pytest.raises(ValueError, match="attn_implementation 'sdpa'.*register"):
        engine.forward_loss(samples, False)


def test_lora_on_a_vision_model_still_packs():
    """PEFT wraps the model: the check must look inside (it saw no rotary index and fell back to
    padded micro-batches over the cap)."""
    vl, vocab = ROOT / "configs" / "tiny_vl_model.json", len(bundled_tokenizer())
    lora = json.loads((ROOT / "configs" / "lora.json").read_text())
    assert supports_packing(build_model(vl, seed=0, vocab_size=vocab))
    assert supports_packing(build_model(vl, seed=0, vocab_size=vocab, lora=lora))
