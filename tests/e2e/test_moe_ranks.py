"""A mixture-of-experts model trained by ``launch/train.py`` on two CPU ranks: one step equals one process.

2 ranks, GAS 2, static shards: rank 0 trains two micro-batches, rank 1 one and a dummy (three
chats of 29, 45 and 61 tokens under ``max_tokens`` 61: one sample per micro-batch). At ZeRO-3
(DeepSpeed; every parameter partitioned, the experts' 3-D tensors gathered per layer)
and under FSDP2 (each decoder layer a unit), one SGD step must move every weight by
``lr x`` the gradient of the step's objective computed on one process with the model's own
forward and eager attention on each sample alone (:mod:`odb.training.model.moe`)::

    sum_i CE_i / N  +  coef * sum_i aux_i * T_i / T      (aux_i: the model's own aux_loss on sample i,
                                                          T_i its tokens, T = sum_i T_i, N label tokens)

and the step's ``aux_loss`` in ``metrics.jsonl`` must be ``sum_i aux_i * T_i / T``. A rank that
skipped a module call (an expert module not hit, say) would hang the launch (its timeout fails the
test). Models: Qwen3-MoE (every weight trained), and gpt-oss (attention sinks, alternating
sliding-window layers of 16 tokens) with LoRA on its attention and activation checkpointing at
ZeRO-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_fsdp2 import check_audit, checkpoint_model, fsdp_config, three_chats

from conftest import bundled_tokenizer
from launch import ROOT, deepspeed, ds_config, fsdp2, odb_config, write_json
from odb.data.processing import SampleDataset
from odb.training.model.build import build_model, hf_model
from odb.training.step.loss import token_loss_sum

TOKENIZER = bundled_tokenizer()
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
             "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.1,
             "initializer_range": 0.1, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 1}
GPT_OSS = {**{k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "moe_intermediate_size")},
           "model_type": "gpt_oss", "num_local_experts": 4, "sliding_window": 16}
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())


def zero3_weights(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step1")


def fsdp2_weights(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    return checkpoint_model(out / "checkpoints" / "step1", tmp)


BACKENDS = {  # launcher, its flags, the trained weights after the step
    "zero3": (deepspeed, lambda tmp: ["--deepspeed_config", str(ds_config(tmp, 3, gradient_clipping=0.0))],
              zero3_weights),
    "fsdp2": (fsdp2, lambda tmp: ["--backend", "fsdp2", "--fsdp_config",
                                     str(fsdp_config(tmp, gradient_clipping=0.0))], fsdp2_weights),
}
CASES = {  # backend, model, flags
    "zero3": ("zero3", QWEN3_MOE, ()),
    "fsdp2": ("fsdp2", QWEN3_MOE, ()),
    "zero3-gpt_oss-lora-checkpointing": ("zero3", GPT_OSS, ("--lora", "--gradient_checkpointing")),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_one_moe_step_on_two_ranks_equals_one_process(tmp_path, case):
    backend, config, extra = CASES[case]
    launch, flags, weights = BACKENDS[backend]
    data, out, lr = three_chats(tmp_path), tmp_path / "out", 1e4
    model_path = write_json(tmp_path / "moe.json", config)
    launch([*flags(tmp_path), *extra, "--model", str(model_path), "--data", str(data),
            "--odb_config", str(odb_config(tmp_path, max_tokens=61, window=4, gas=2, sharding="static")),
            "--output_dir", str(out), "--optimizer", "sgd", "--lr", str(lr), "--warmup_ratio", "0", "--audit_ids",
            "--num_workers", "0"])
    rows = check_audit(out, 2, 3)
    assert len(rows[0]) == 2 and sum(not r["ids"] for rank in rows for r in rank) == 1  # 1 step, 1 dummy
    after = weights(out, tmp_path)

    model = build_model(model_path, seed=0, vocab_size=len(TOKENIZER), lora=LORA if "--lora" in extra else None)
    hf_model(model).set_attn_implementation("eager")  # the model's own attention, not odb's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = SampleDataset(data, TOKENIZER)
    samples = [dataset[i] for i in range(3)]
    total_tokens = sum(len(s["input_ids"]) for s in samples)
    label_tokens = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    token_loss, aux = 0.0, 0.0
    for sample in samples:
        output = model(input_ids=sample["input_ids"][None], use_cache=False, output_router_logits=True)
        token_loss = token_loss + token_loss_sum(output.logits, sample["labels"][None])
        aux = aux + output.aux_loss * len(sample["input_ids"]) / total_tokens
    (token_loss / label_tokens + hf_model(model).router_aux_loss_coef * aux).backward()
    with torch.no_grad():
        moved = {n: lr * p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
        worst, name = max((float(((after[n] - before[n]) + step).abs().max() / step.abs().max()), n)
                          for n, step in moved.items())
        still = max((float((after[n] - before[n]).abs().max()) for n, _ in model.named_parameters()
                     if n not in moved and n in after), default=0.0)
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["aux_loss"]
    print(f"{case} {config['model_type']}: {len(moved)} of {len(before)} tensors moved, worst relative error "
          f"{worst:.2e} ({name}), largest change of a tensor without gradient {still:.1e}; step aux_loss logged "
          f"{logged:.6f}, one process {aux.item():.6f}")
    assert worst <= 1e-5 and still == 0.0
    assert "--lora" in extra or len(moved) == len(before)  # (LoRA: the frozen base, and lora_A while B = 0)
    assert abs(logged - aux.item()) <= 1e-5 * aux.item()
