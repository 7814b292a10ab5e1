"""Models too big for one rank, in one process: the training precision read from the resolved
DeepSpeed config, the gradient-checkpointing flag, and activation checkpointing's gradients on a
packed row of images against the same step without it (the oracle). The partitioned builds at
ZeRO-3 on 2 ranks: tests/e2e/test_big_models.py."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, bundled_tokenizer
from odb.data.collate import collate_packed
from odb.data.processing import DataConfig, SampleDataset
from odb.training.backends.deepspeed_config import training_dtype
from odb.training.launch.flags import FileDefaults, parse_config
from odb.training.model.build import build_model, vision_spec
from odb.training.model.mrope import packed_position_ids

TOKENIZER = bundled_tokenizer()
VL = ROOT / "configs" / "tiny_vl_model.json"
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())


def test_training_dtype_follows_the_resolved_deepspeed_config():
    assert training_dtype(None) == torch.float32
    assert training_dtype({"bf16": {"enabled": True}}) == torch.bfloat16
    assert training_dtype({"bfloat16": {"enabled": True}}) == torch.bfloat16
    assert training_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == torch.float16
    assert training_dtype({"bf16": {"enabled": "auto"}}) == torch.float32  # unresolved: never guessed


def test_the_gradient_checkpointing_flag_reaches_the_run_config(tmp_path):
    configs = ROOT / "configs"
    defaults = FileDefaults(deepspeed_config=configs / "ds_zero3.json", odb_config=configs / "odb.json",
                            model=configs / "tiny_model.json", data=ROOT / "data" / "chat.jsonl",
                            tokenizer=ROOT / "data" / "tokenizer", lora=configs / "lora.json")
    fresh = ["--output_dir", str(tmp_path / "run")]  # (not runs/default, which a README run may have filled)
    assert not parse_config(fresh, defaults=defaults).model.gradient_checkpointing
    config = parse_config(["--gradient_checkpointing", *fresh], defaults=defaults)
    assert config.model.gradient_checkpointing and config.to_dict()["model"]["gradient_checkpointing"] is True


def vl_grads(lora, checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of the tiny Qwen2-VL model on one packed row of four image samples, and how
    often its first vision block ran."""
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER), lora=lora, gradient_checkpointing=checkpointing)
    base = model.get_base_model() if lora else model
    assert not [h for m in base.modules() for h in m._forward_hooks.values()
                if getattr(h, "__name__", "").startswith("make_inputs_require_grad")]  # reentrant's needs only
    calls = []
    base.model.visual.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    dataset = SampleDataset(ROOT / "data" / "mm" / "train.jsonl", TOKENIZER, vision=vision_spec(base, DataConfig()))
    batch = collate_packed([dataset[i] for i in range(4)])
    labels = batch.pop("labels")
    batch["position_ids"] = packed_position_ids(base, batch["input_ids"], batch["cu_seq_lens_q"],
                                                batch["image_grid_thw"])
    logits = model(**batch, use_cache=False).logits
    F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, len(calls)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_checkpointed_gradients_of_packed_image_rows_equal_plain_ones(lora):
    """One process, odb's varlen attention over a packed row: the recomputed language layers and
    vision blocks give the gradients the plain backward gives. With LoRA the frozen vision tower
    has nothing to train: no backward through it, so no recomputation either (inputs are not made
    to require grad: non-reentrant checkpoints do not need it)."""
    plain, plain_runs = vl_grads(lora, checkpointing=False)
    grads, runs = vl_grads(lora, checkpointing=True)
    assert grads.keys() == plain.keys()
    worst = max(float((grads[n] - plain[n]).abs().max() / plain[n].abs().max().clamp_min(1e-30)) for n in plain)
    print(f"VL {'LoRA' if lora else 'full'}: worst relative gradient difference {worst:.2e}; "
          f"first vision block ran {plain_runs} / {runs} times")
    assert worst <= 1e-5 and plain_runs == 1 and runs == (1 if lora else 2)
    assert sum(int(g.abs().max() > 0) for g in plain.values()) >= len(plain) // 2  # gradients that say something
