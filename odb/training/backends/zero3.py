"""ZeRO-3's construction of a model: partitioned while it is built (``deepspeed.zero.Init``), a
folder's weights through transformers' DeepSpeed integration, a random init drawing exactly the
numbers a plain ``from_config`` draws (:func:`_zero3_random_init`). Used by
:func:`odb.training.backends.deepspeed.build_model`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Zero3Construction"]


class Zero3Construction:
    """ZeRO-3's way to construct a model (:class:`odb.training.model.build.Construction`)."""

    def __init__(self, ds_config: Mapping[str, Any]) -> None:
        self.ds_config = ds_config

    def random_init(self):  # (not transformers' own ZeRO-3 path: it would draw other numbers)
        return _zero3_random_init(self.ds_config)

    def pretrained(self):  # transformers builds it under zero.Init, then fills each parameter gathered
        return _hf_zero3(self.ds_config)


@contextmanager
def _hf_zero3(ds_config: Mapping[str, Any]) -> Iterator[None]:
    """transformers' and PEFT's ZeRO-3 code paths on (``is_deepspeed_zero3_enabled()``), while the
    model is built only: transformers looks the config up through a weak reference to this object."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    held = HfDeepSpeedConfig(dict(ds_config))
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del held


@contextmanager
def _zero3_random_init(ds_config: Mapping[str, Any]) -> Iterator[None]:
    """``from_config`` under ``deepspeed.zero.Init``, drawing the numbers a plain ``from_config`` draws.

    A plain build interleaves two inits, in this order: torch's default init of each module as it is
    constructed, and transformers' ``initialize_weights`` at the end of each sub-model's constructor
    (children first). ``zero.Init`` runs the first on each module's whole tensors before it
    partitions them; transformers' own ZeRO-3 path skips both and re-initializes afterwards, which
    draws other numbers. Here ``PreTrainedModel.initialize_weights`` is replaced, while the model is
    constructed, by one that gathers each module's parameters while it initializes them, on every
    rank (the same numbers drawn everywhere, rank 0's kept): the random stream is the plain build's,
    one module whole at a time. (No causal LM of transformers 5.24 overrides ``initialize_weights``.)
    """
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    plain = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = _initialize_weights_gathered
    try:
        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=dict(ds_config)):
            yield
    finally:
        PreTrainedModel.initialize_weights = plain


@torch.no_grad()
def _initialize_weights_gathered(model) -> None:
    """``PreTrainedModel.initialize_weights`` on ZeRO-3 partitions: each module's ``_initialize_weights``
    (a sub-model's own for its modules), children first, with the module's parameters and those of
    its plain children gathered (transformers' ``initialize_weights_zero3``, but on every rank)."""
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_custom_code()

    def visit(module: torch.nn.Module, init) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        if getattr(module, "_is_hf_initialized", False):
            return  # done by a sub-model's own constructor: ``_initialize_weights`` would skip it
        plain_children = [c for c in module.children() if not isinstance(c, PreTrainedModel)]
        params = [*module.parameters(recurse=False), *(p for c in plain_children for p in c.parameters(recurse=False))]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            init(module, custom)

    with guard_torch_init_functions():
        visit(model, model._initialize_weights)
