"""The model and tokenizer: a local Hugging Face folder, or a config JSON for a random-init model;
optional PEFT LoRA; odb's varlen attention registered and selected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from odb.attention import register

__all__ = ["load_tokenizer", "build_model"]


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
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = register()
    path = Path(path)
    if path.is_file():
        config = AutoConfig.for_model(**json.loads(path.read_text()))
        torch.manual_seed(seed)  # the same random init on every rank
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn, dtype=dtype)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}; use the model's own tokenizer (--tokenizer)")
    model.config.use_cache = False  # packed samples leak into each other through the cache
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    return model
