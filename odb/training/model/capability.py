"""Whether odb can pack a model family exactly, told before any weight is read.

odb packs several samples into one row and keeps them apart in attention only (``cu_seqlens``,
:mod:`odb.training.attention.varlen`). That is exact for a model whose only token mixer is attention.
A layer that mixes tokens any other way carries state along the row, from one sample into the
next:

* state-space and recurrent layers (Mamba / Mamba-2 mixers: Jamba, Bamba, Falcon-H1, Zamba,
  Nemotron-H, Granite-4 hybrids; RecurrentGemma's RG-LRU; RWKV);
* linear attention (Qwen3-Next's and Qwen3.5's gated delta-net, Kimi-Linear, MiniMax's lightning
  attention, OLMo-hybrid);
* short causal convolutions over the sequence (LFM2's ``ShortConv``, ZAYA's convolved attention
  projections): a kernel of ``k`` taps lets the first ``k - 1`` tokens of a sample see the end of
  the previous one; xLSTM's cells.

And a model whose attention does not go through transformers' attention interface (its class
says ``_supports_attention_backend = False``: BLOOM, MPT, XGLM, Falcon, GPT-Neo, ...) never calls
odb's attention at all: it would attend across the packed row. The engine checks the same thing
at the first packed forward (:class:`odb.training.step.engine.OdbEngine`), for a model that slips past.

transformers' own kernels for some of these take ``cu_seqlens`` on GPU (flash-linear-attention,
causal-conv1d), but their CPU paths do not, and odb cannot check the GPU ones here. So such a
model is refused at start (:func:`packing_refusal`), naming the layers; it is never trained with
state leaking across packed samples. The check reads module classes only, on a skeleton built on
the ``meta`` device from the config (:func:`skeleton`): seconds for a 70B config, no weights read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

__all__ = ["packing_refusal", "skeleton", "token_mixers"]

# Class names of token mixers that are not attention (transformers 5.24 spells them so).
# (Kimi-Linear's ``KimiLinearAttention`` is its full MLA attention; its linear layers are ``...DeltaAttention``.)
_NOT_ATTENTION = re.compile(r"Mamba\d?Mixer|MambaLayer|^\w*Mixer$|DeltaNet|DeltaAttention|(?<!^Kimi)LinearAttention"
                            r"|LightningAttention|ShortConv|ShortConvolution|CCAProjection|RecurrentBlock|Rglru"
                            r"|^Rwkv\w*Attention$|^xLSTMLayer$")


def token_mixers(model: torch.nn.Module) -> list[str]:
    """The distinct class names of ``model``'s modules that mix tokens other than by attention."""
    return sorted({type(m).__name__ for m in model.modules() if _NOT_ATTENTION.search(type(m).__name__)})


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why odb cannot pack ``model`` exactly (a sentence naming its layers and the way out), or None."""
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", type(model).__name__)
    found = token_mixers(model)
    if not found:
        if getattr(type(model), "_supports_attention_backend", False):
            return None
        return (f"odb cannot pack {name}: {type(model).__name__} computes attention its own way, not through "
                "transformers' attention interface, so odb's per-sample attention would never run and packed samples "
                "would attend to each other. Fine-tune it with a trainer that pads each sample to its own row")
    return (f"odb cannot pack {name}: its layers {found} mix tokens by recurrence, linear attention or convolution, "
            "so packed samples would leak state into each other (odb keeps samples apart in attention only). "
            "Fine-tune it with a trainer that pads each sample to its own row; odb refuses it rather than train "
            "it wrong")


def skeleton(path: str | Path) -> torch.nn.Module:
    """The model of a Hugging Face folder or a model config JSON, every tensor on ``meta`` (no
    weights read, no memory): for checks of its structure."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(path)
    config = AutoConfig.for_model(**json.loads(path.read_text())) if path.is_file() else \
        AutoConfig.from_pretrained(str(path))
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)
