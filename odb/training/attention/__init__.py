"""Varlen attention for packed rows, registered with transformers as ``"odb_varlen"``.

A packed row holds several samples back to back (``cu_seqlens`` marks where each begins); each
sample must attend only to itself. transformers' own answer on CPU is a dense ``T x T`` block
mask, which is slower than padding (docs/design.md, attention semantics). This package
computes attention per sample instead, and does for each sample what the model asked for:

* ``is_causal`` (the argument, else ``module.is_causal``): decoder layers are causal; the vision
  towers of Qwen2-VL / Qwen2.5-VL / Qwen3-VL call with ``is_causal=False`` (bidirectional).
* ``sliding_window=w`` (Mistral, Qwen2, Gemma-2's sliding layers): the query at position i sees
  keys ``i - w + 1 .. i`` of its own sample, as transformers' ``sliding_window_overlay``.
* ``softcap=c`` (Gemma-2): scores become ``c * tanh(scores / c)`` before the mask and softmax.
* ``dropout=p`` (train mode): dropout on each sample's own attention probabilities.
* ``s_aux`` (gpt-oss's attention sinks, one learned logit ``s_h`` per head): the sink joins each
  query's softmax denominator and is dropped after, as gpt-oss's eager attention does::

      p_ij = exp(z_ij) / (sum_{j' visible} exp(z_ij') + exp(s_h))     out_i = sum_j p_ij v_j

* ``output_router_logits`` (the MoE families: Qwen2/3-MoE, OLMoE, Mixtral, gpt-oss): a flag that
  only tells the layer what to return; nothing to do here (:mod:`odb.training.model.moe` adds the
  router loss).

Paths:

* CUDA, fp16/bf16: FlashAttention-3 (Hopper; no dropout) or the flash-attn package's varlen kernel
  when installed (all of the above but sinks: no released Flash Attention kernel has them); else
  PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (causal, windows, bidirectional; no dropout,
  softcap or sinks), each called with what the installed release's signature has
  (:mod:`odb.training.attention.kernels`); a value head dim other than q's (MLA) is padded to it.
  What no kernel computes falls to the grouped path below, with a one-time warning.
* Everywhere else: ``scaled_dot_product_attention`` over groups of samples of similar length, each
  group right-padded *inside attention only* (the MLPs and projections see no padding). Causal
  rows pass ``is_causal=True`` and no mask (real queries never see the padded keys, which all lie
  in their future): the CPU fast path. A window adds a banded mask, bidirectional attention a
  key-padding mask, and softcap or sinks the plain ``scores -> tanh -> mask -> [sink] softmax``
  per group (:func:`explicit_attention`).

Rows with an ``attention_mask`` (the padded baselines) go to transformers' SDPA unchanged: their
mask already holds the window; softcap and sinks, which SDPA lacks, take the per-group math.
:func:`attention_path` names the path a device takes (the start banner) after one checked call.
Any other argument that arrives with a value raises (:data:`HANDLED_KWARGS` lists those handled).
Always run the model with ``use_cache=False`` when training packed rows: with a cache,
transformers 5.24 lets packed samples attend to each other on eager/SDPA (measured; docs/design.md).

Modules, each using only those above it:

    semantics.py   what a call asks for (:class:`semantics.Pattern`), the arguments handled, the
                   sample bounds of a call, the paths' call counts
    explicit.py    masks and the eager-order math (softcap, sinks) SDPA lacks
    grouped.py     the CPU path: samples of similar length batched per SDPA call
    kernels.py     the Flash Attention varlen kernels, as the installed releases spell them
    cuda.py        the CUDA path through those kernels, and the start-up probe (:func:`attention_path`)
    varlen.py      :func:`varlen_attention`, the function transformers calls, and its registration
"""

from odb.training.attention.cuda import attention_path, has_flash_attn
from odb.training.attention.semantics import HANDLED_KWARGS, calls, cu_seqlens_from_position_ids
from odb.training.attention.varlen import ATTN_IMPLEMENTATION, register, route_through, varlen_attention

__all__ = ["ATTN_IMPLEMENTATION", "HANDLED_KWARGS", "attention_path", "calls", "cu_seqlens_from_position_ids",
           "has_flash_attn", "register", "route_through", "varlen_attention"]
