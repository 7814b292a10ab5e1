"""The router load-balancing loss of mixture-of-experts models, over each micro-batch's real tokens.

transformers' MoE causal LMs (Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE, OLMoE, Mixtral, gpt-oss, and
every other family whose forward takes ``output_router_logits``) add a router loss to their own
``loss`` when called with labels and ``output_router_logits=True``::

    loss = CE_mean + coef * aux                      coef = router_aux_loss_coef (the model's)
    aux  = E * sum_e f_e * P_e                       the family's load_balancing_loss_func, over the
                                                     rows (tokens x MoE layers) of the call that its
                                                     attention_mask keeps:
           f_e = share of the rows' top-k assignments that go to expert e
           P_e = mean router probability of expert e over the rows

No family odb trains has a router z-loss in transformers 5.24 (only the encoder-decoders
Switch-Transformers and NLLB-MoE do); DeepSeek-V2/V3 and GLM-4-MoE balance by a routing bias and
have no router loss (their forward takes no ``output_router_logits``: :func:`router_loss` is None).

``aux`` is a product of means, not a sum over tokens, so it does not split over micro-batches as
the token loss does. odb computes it per micro-batch m with the family's own function, over m's
real tokens only (a mask: never padding, never a dummy's token, never the blank image the engine
adds to an imageless VL micro-batch), and trains the step's token-weighted mean::

    aux_s      = sum_{r,m} aux_{r,m} * T_{r,m} / T_s      T_{r,m}: real tokens of micro-batch m on rank r
                                                          T_s = sum_{r,m} T_{r,m} (plan.rank_tokens)
    loss_{r,m} = sum_t l_{r,m,t} * W / N_s  +  coef * aux_{r,m} * T_{r,m} * W / T_s

The backends average gradients over the W ranks, so the step's gradient is
``grad(sum l / N_s + coef * aux_s)``. With one sample per micro-batch and one micro-batch per
step on one rank that is exactly ``model(labels=..., output_router_logits=True).loss``. A dummy
backs 0. ``aux_s`` is logged per step as ``aux_loss`` (without ``coef``, as the model's own
``aux_loss`` output).

ZeRO-3 and FSDP2: in transformers 5.24 every MoE family's experts are one module with 3-D
parameters (``[E, ...]``, called once per MoE layer whatever the routing), so every rank gathers
the same parameters in the same order; the router loss only reuses the router logits the forward
made (no extra module call).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from odb.training.model.build import hf_model

__all__ = ["RouterLoss", "router_loss"]


@dataclass
class RouterLoss:
    """A model's router load-balancing loss, its own function, coefficient and sizes.

    Args:
        load_balancing: the family module's ``load_balancing_loss_func(router_logits, num_experts,
            top_k, attention_mask)``.
        num_experts / top_k / coef: what the model's own forward passes it and multiplies it by.
        model_type: for messages.
    """

    load_balancing: Callable[..., torch.Tensor]
    num_experts: int
    top_k: int
    coef: float
    model_type: str
    _checked: bool = field(default=False, repr=False)

    @property
    def call_kwargs(self) -> dict[str, bool]:
        """What the model is called with so that it returns its router logits."""
        return {"output_router_logits": True}

    def __call__(self, output: Any, real_tokens: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``aux`` of one model call over its real tokens.

        Args:
            output: the model's output, called with :attr:`call_kwargs`.
            real_tokens: ``[B, T]``, 1 where a token is a sample's own (0: padding, the blank image).
            attention_mask: the mask the call was given (padded rows), or None (a packed row).
        """
        router_logits = getattr(output, "router_logits", None)
        if not router_logits:
            raise ValueError(f"{self.model_type} returned no router_logits with output_router_logits=True; "
                             "odb cannot add its router loss (odb/training/model/moe.py)")
        router_logits = tuple(router_logits)
        if not self._checked:
            self._check(output, router_logits, attention_mask)
        return self.load_balancing(router_logits, self.num_experts, self.top_k, real_tokens)

    @torch.no_grad()
    def _check(self, output: Any, router_logits: tuple[torch.Tensor, ...], attention_mask) -> None:
        """The first call: the function over the call's own mask must give the model's own aux_loss,
        else this family computes its router loss some other way."""
        own = getattr(output, "aux_loss", None)
        mine = self.load_balancing(router_logits, self.num_experts, self.top_k, attention_mask)
        if own is None or not torch.allclose(torch.as_tensor(mine).float(), torch.as_tensor(own).float().to(
                torch.as_tensor(mine).device), rtol=1e-5, atol=1e-7):
            raise ValueError(f"odb's router loss for {self.model_type} ({float(mine):.6g}) is not the model's own "
                             f"aux_loss ({own}): this family computes it in a way odb/training/model/moe.py does "
                             "not know")
        self._checked = True


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def router_loss(model: torch.nn.Module) -> RouterLoss | None:
    """The router loss ``model``'s own forward adds under ``output_router_logits=True`` and labels,
    or None for a model without one (dense models; DeepSeek-V3's bias balancing).

    Raises:
        ValueError: the model takes ``output_router_logits`` but odb cannot find its router loss
            (function, number of experts, top-k or coefficient).
    """
    base = hf_model(model)
    if "output_router_logits" not in inspect.signature(base.forward).parameters:
        return None
    config = base.config
    text = getattr(config, "text_config", None) or config
    # the family's module (FSDP2's fully_shard makes a subclass of the model's class in torch's)
    function = next((f for cls in type(base).__mro__
                     if (f := getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None))), None)
    num_experts = _first(getattr(base, "num_experts", None), getattr(text, "num_experts", None),
                         getattr(text, "num_local_experts", None))
    top_k = _first(getattr(base, "num_experts_per_tok", None), getattr(text, "num_experts_per_tok", None))
    coef = _first(getattr(base, "router_aux_loss_coef", None), getattr(text, "router_aux_loss_coef", None))
    if function is None or None in (num_experts, top_k, coef):
        raise ValueError(f"{config.model_type} takes output_router_logits but odb cannot find its router loss "
                         f"(load_balancing_loss_func {'found' if function else 'missing'}, num_experts {num_experts}, "
                         f"num_experts_per_tok {top_k}, router_aux_loss_coef {coef}); odb/training/model/moe.py must "
                         "learn this family before it can train it")
    return RouterLoss(function, int(num_experts), int(top_k), float(coef), config.model_type)
