"""The model and tokenizer: a local Hugging Face folder, or a config JSON for a random-init model;
optional PEFT LoRA; odb's varlen attention registered and selected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from odb.data.images import VisionSpec
from odb.training.attention import register

__all__ = ["build_model", "load_tokenizer", "vision_spec"]


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {path} has no chat template; odb formats samples with "
                         "apply_chat_template (set tokenizer.chat_template and save it)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(path: str | Path, *, seed: int, vocab_size: int, lora: dict[str, Any] | None = None,
                dtype: torch.dtype = torch.float32):
    """A causal LM with ``attn_implementation="odb_varlen"``; ``use_cache`` off for training."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    attn = register()
    path = Path(path)
    config = AutoConfig.for_model(**json.loads(path.read_text())) if path.is_file() else \
        AutoConfig.from_pretrained(str(path))
    # Image-text models (Qwen2-VL, Qwen3-VL, ...) load through their own auto class.
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    if path.is_file():
        torch.manual_seed(seed)  # the same random init on every rank
        model = auto.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        model = auto.from_pretrained(str(path), attn_implementation=attn, dtype=dtype)
    text_config = getattr(model.config, "text_config", model.config)
    if text_config.vocab_size < vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
                         f"{text_config.vocab_size}; use the model's own tokenizer (--tokenizer)")
    model.config.use_cache = False  # packed samples leak into each other through the cache
    model.train()  # from_pretrained leaves a model in eval mode: dropout off
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    return model


def vision_spec(model, data_config) -> VisionSpec | None:
    """The image geometry the model's vision tower expects (None for a text model)."""
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return None
    return VisionSpec(min_pixels=data_config.min_pixels, max_pixels=data_config.max_pixels,
                      patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                      merge_size=vision.spatial_merge_size)
