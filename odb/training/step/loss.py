"""Next-token cross entropy from the final hidden states, the vocabulary done in chunks of tokens.

The full-logits loss (:func:`odb.training.step.loss.token_loss_sum`) makes ``logits [B, T, V]`` and
casts them to fp32: at V = 152064 and T = 8192 that is 5 GB for the logits alone and as much again
for their gradient. Here the row's logits never exist at once. With ``h[b, t]`` the final hidden
state (what the LM head consumes: after the final norm), ``W`` (and ``b``) the head, ``y`` the
labels and ``cap`` the model's final soft-capping (Gemma-2; the identity for the others)::

    loss = sum over (b, t), t < T - 1, y[b, t + 1] != -100 of  CE( cap(W h[b, t] + b), y[b, t + 1] )
    CE(z, y) = logsumexp(z) - z[y]    in fp32        cap(z) = c * tanh(z / c)   (c: final_logit_softcapping)

It is a sum over tokens, so it splits exactly over any partition of the scored tokens into chunks
``K_1 .. K_n``, and so does its gradient::

    loss     = sum_k L_k              L_k = sum_{i in K_k} CE(cap(W h_i + b), y_i)
    dL/dh_i  = dL_k/dh_i  (i in K_k)  dL/dW = sum_k dL_k/dW

Each chunk's logits ``[c, V]`` are made, reduced to one fp32 number and freed in the forward, and
made again in the backward (``torch.utils.checkpoint``, non-reentrant): the loss holds a few
``c x V`` fp32 tensors at its peak instead of ``T x V``, plus one more ``V x H`` weight gradient
while autograd adds a chunk's to the sum of the others (tools/bench/bench_memory.py, V 152064, H 1024,
fp32: T 8192 in 8 chunks 2.6 GB against 14.3 GB; T 2048 in 2 chunks 2.5 GB against 3.6 GB, of
which 1.2 GB are the two weight gradients). Tokens whose label is -100 are dropped
before the head (they add 0 to the sum and to every gradient). Worked example, one packed row,
``T = 6``, two chunks::

    labels            -100   a1   a2  -100   b1   b2
    shifted (t -> t+1)  a1   a2 -100    b1   b2 -100      the label each position predicts
    scored positions     0    1          3    4            N = 4 rows of h, gathered once
    chunks             [0 1]     [3 4]                    n = 2: rows [N*k/n, N*(k+1)/n)

ZeRO-3. The chunks run inside one call of the head module (:func:`call_as_forward`): DeepSpeed's
hooks on the head gather its weight (a tied embedding weight too) once before the chunk loop and
release it after; the call's output, the loss, carries the head's pre-backward hook, so in the
backward the weight is gathered once, before any chunk is recomputed, and released when the
gradient of the hidden states is complete. Where the caller backs the per-source sums instead (a
:class:`~odb.training.step.sources.SourceSplit` with ``graph``: each preference sequence's own
loss), those sums are the call's output: a loss built beside the call's output would reach the
chunks without the hook, and recompute them with the weight released. The model's own call of
the head, on one position, adds one gather in the forward. A head whose forward calls
sub-modules (a LoRA-wrapped head) has them gathered per chunk, each gather a collective: so the
number of chunks ``n`` is fixed per engine (:func:`num_loss_chunks` of the micro-batch token
cap), never derived from a row, and a row with fewer scored tokens than chunks gets zero rows
labelled -100 (a dummy micro-batch runs ``n`` chunks of those): every rank runs the same calls.

Liger's fused linear cross entropy (``liger_kernel``, not a dependency) computes the same sum with
its own Triton kernels; :class:`HeadLoss` uses it where it can: importable, a CUDA head that is a
plain ``nn.Linear`` and is not partitioned by ZeRO-3 (Liger reads the weight directly, and that
is only the whole weight outside ZeRO-3). Everywhere else the chunked path runs.

Per source (a data mixture): a :class:`odb.training.step.sources.SourceSplit` passed to the loss
gets each source's sum from the very token losses whose sum is backed: each chunk's losses come
out per token (``reduction="none"``, ``[c]`` instead of one number; the logits are still made and
freed chunk by chunk) and are added into their sources with one ``index_add``; the full-logits loss
does the same over its ``[B, T - 1]`` losses; Liger's fused loss, which gives only a sum, runs once
per source present, on that source's scored rows (the same total, and no more logits at once).
Without a split (one source in the call) nothing changes: the per-source sum is the call's own.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from odb.training.config.settings import DEFAULT_LOSS_CHUNK_TOKENS
from odb.training.step.sources import SourceSplit

__all__ = ["DEFAULT_LOSS_CHUNK_TOKENS", "HeadLoss", "call_as_forward", "chunked_token_loss_sum",
           "final_logit_softcap", "liger_loss", "num_loss_chunks", "scored_tokens", "softcap_logits",
           "token_loss_sum"]



def num_loss_chunks(max_tokens: int, chunk_tokens: int) -> int:
    """Chunks per micro-batch: enough that a micro-batch of ``max_tokens`` scored tokens has chunks
    of at most ``chunk_tokens``; the same on every rank (see the ZeRO-3 note above)."""
    if chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens must be >= 1 (or None for full logits), got {chunk_tokens}")
    return max(1, math.ceil(max_tokens / chunk_tokens))


def final_logit_softcap(config) -> float | None:
    """The model's final logit soft-capping ``c`` (Gemma-2's ``final_logit_softcapping``), or None."""
    text_config = getattr(config, "text_config", None) or config
    return getattr(config, "final_logit_softcapping", None) or getattr(text_config, "final_logit_softcapping", None)


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, in the model's own order of operations (identity for None)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _chunk_loss(project: Callable[[torch.Tensor], torch.Tensor], hidden_ch: torch.Tensor, labels_c: torch.Tensor,
                cap: float | None, reduction: str = "sum") -> torch.Tensor:
    logits_cv = softcap_logits(project(hidden_ch), cap)
    return F.cross_entropy(logits_cv.float(), labels_c, ignore_index=-100, reduction=reduction)


def _scored(hidden: torch.Tensor, labels: torch.Tensor, *, min_rows: int = 0, split: SourceSplit | None = None,
            shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`scored_tokens`, and with ``split`` the source of each scored row ``[N]`` (0 for the
    rows added up to ``min_rows``)."""
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    if shifted:  # already what each position predicts (sequence parallelism's slices)
        shifted_bt = labels
    else:
        shifted_bt = torch.full_like(labels, -100)
        shifted_bt[:, :-1] = labels[:, 1:]
    keep_n = (shifted_bt.flatten() != -100).nonzero().squeeze(1)
    hidden_nh, labels_n = hidden.flatten(0, 1).index_select(0, keep_n), shifted_bt.flatten().index_select(0, keep_n)
    sources_n = None if split is None else split.predicted().flatten().index_select(0, keep_n)
    missing = min_rows - labels_n.numel()
    if missing > 0:
        hidden_nh = torch.cat([hidden_nh, hidden_nh.new_zeros(missing, hidden_nh.shape[1])])
        labels_n = torch.cat([labels_n, labels_n.new_full((missing,), -100)])
        if sources_n is not None:
            sources_n = torch.cat([sources_n, sources_n.new_zeros(missing)])
    return hidden_nh, labels_n, sources_n


def scored_tokens(hidden: torch.Tensor, labels: torch.Tensor, *,
                  min_rows: int = 0, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``hidden [B, T, H]`` whose next label counts, and those labels: ``[N, H]``, ``[N]``
    (the shift inside each row; one host sync for N); then zero rows labelled -100 up to ``min_rows``."""
    hidden_nh, labels_n, _ = _scored(hidden, labels, min_rows=min_rows, shifted=shifted)
    return hidden_nh, labels_n


def call_as_forward(module: torch.nn.Module, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` run as ``module``'s forward, through ``module(...)``: every hook on the
    module wraps the whole function once (ZeRO-3: one gather of its parameters before, their
    release after, and the same around the backward of what it returns)."""
    saved = module.__dict__.get("forward")
    module.forward = function  # an instance attribute shadows the class's forward for this call
    try:
        return module(*args)
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


def chunked_token_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                           *, num_chunks: int, softcap: float | None = None,
                           split: SourceSplit | None = None, shifted: bool = False) -> torch.Tensor:
    """Summed next-token cross entropy, the head applied chunk by chunk (the module docstring's math).

    Args:
        hidden: the final hidden states ``[B, T, H]``, what the LM head consumes.
        labels: ``[B, T]``, -100 ignored; logits at t predict labels at t + 1 (shifted here).
        head: the LM head; a module runs the chunk loop inside one call of itself
            (:func:`call_as_forward`), its own forward applied to each chunk.
        num_chunks: chunks of the scored tokens; the head's forward runs exactly this many times.
        softcap: the model's final logit soft-capping, applied after the head (None: none).
        split: receives each source's summed token loss (the module docstring), or None.
        shifted: ``labels`` are already what each position predicts (no shift here).

    Returns:
        The fp32 sum; with gradients enabled each chunk's logits are recomputed in the backward.
        With ``split.graded`` (each source's sum with its gradients) the head's call returns that
        instead, and ``split.graded`` is what it returned.
    """
    # every chunk non-empty: the same calls and autograd graph on every rank
    hidden_nh, labels_n, sources_n = _scored(hidden, labels, min_rows=num_chunks, split=split, shifted=shifted)
    chunks = partial(_sum_of_chunks, head.forward if isinstance(head, torch.nn.Module) else head,
                     num_chunks=num_chunks, softcap=softcap, split=split, sources_n=sources_n)
    if not isinstance(head, torch.nn.Module):
        return chunks(hidden_nh, labels_n)
    if split is None or split.graded is None:
        return call_as_forward(head, chunks, hidden_nh, labels_n)

    def graded_chunks(hidden_nh: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
        chunks(hidden_nh, labels_n)
        return split.graded

    # what the caller backs is each source's sum with its gradients (preference pairs), not the
    # total: the sums leave the head's call, so that they carry its hooks (ZeRO-3's gather before
    # the chunks are recomputed in the backward)
    split.graded = call_as_forward(head, graded_chunks, hidden_nh, labels_n)
    return split.graded.sum()


def _sum_of_chunks(project: Callable[[torch.Tensor], torch.Tensor], hidden_nh: torch.Tensor, labels_n: torch.Tensor,
                   *, num_chunks: int, softcap: float | None, split: SourceSplit | None = None,
                   sources_n: torch.Tensor | None = None) -> torch.Tensor:
    rows = labels_n.numel()
    bounds = [rows * k // num_chunks for k in range(num_chunks + 1)]
    recompute = torch.is_grad_enabled()
    reduction = "sum" if split is None else "none"  # per source: the chunk's token losses [c]
    total = None
    for start, end in zip(bounds, bounds[1:]):
        args = (project, hidden_nh[start:end], labels_n[start:end], softcap, reduction)
        # ZeRO-3: the recomputation runs after the head's pre-backward hook (the loss this call
        # returns carries it), so the weights it saves are gathered, and stay so until the hidden
        # states' gradient is complete (a frozen one a sub-module gathers is held for the head).
        # The RNG state is kept so that a head with dropout (LoRA's) draws the same mask again.
        chunk = checkpoint(_chunk_loss, *args, use_reentrant=False) if recompute else _chunk_loss(*args)
        if split is not None:
            assert sources_n is not None
            split.add(sources_n[start:end], chunk)
            chunk = chunk.sum()
        total = chunk if total is None else total + chunk
    return total


def liger_loss(head: torch.nn.Module, softcap: float | None) -> Callable[..., torch.Tensor] | None:
    """Liger's fused linear cross entropy (sum, -100 ignored, ``softcap``) as ``f(hidden_nh, labels_n)``,
    or None where it cannot serve this head: not importable, not CUDA, not a plain ``nn.Linear``
    (a LoRA-wrapped head), or a weight partitioned by ZeRO-3 (``ds_id``), or a Liger too old for
    ``softcap``."""
    if type(head) is not torch.nn.Linear or head.weight.device.type != "cuda" or hasattr(head.weight, "ds_id"):
        return None
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum",
                                                 **({} if softcap is None else {"softcap": softcap}))
    except (ImportError, TypeError):
        return None

    def loss(hidden_nh: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
        out = fused(head.weight, hidden_nh, labels_n, head.bias)
        out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
        return out.float()

    return loss


class HeadLoss:
    """The summed next-token loss of a model call, from its LM head's input (not its logits).

    :meth:`forward_loss` runs the model with a forward pre-hook on the head that keeps the head's
    input ``[B, T, H]`` and hands the head only the last position, so the model's own head call
    costs one token per row. The first call checks that what the model returns as logits is
    ``softcap(head(input))`` for that position (a family that transforms its logits otherwise is
    refused, naming the fix).

    Args:
        head: the model's LM head (``get_output_embeddings()``; under PEFT the base model's).
        softcap: the model's final logit soft-capping (:func:`final_logit_softcap`).
        num_chunks: chunks per call (:func:`num_loss_chunks`), the same on every rank.
        fused: use Liger's fused linear cross entropy where :func:`liger_loss` allows it.
    """

    def __init__(self, head: torch.nn.Module, *, softcap: float | None, num_chunks: int, fused: bool = True) -> None:
        self.head = head
        self.softcap = softcap
        self.num_chunks = num_chunks
        self.fused = liger_loss(head, softcap) if fused else None
        self._checked = False

    def forward_loss(self, forward: Callable[[], Any], labels: torch.Tensor, split: SourceSplit | None = None,
                     *, shifted: bool = False) -> torch.Tensor:
        """Runs ``forward()`` (the model call, returning an output with ``.logits``) and returns the
        fp32 sum of its next-token cross entropy over ``labels [B, T]`` (``shifted``: labels already
        shifted, each position's own target); ``split`` receives each source's sum (or None)."""
        seen: dict[str, torch.Tensor] = {}

        def keep_input(module, args):
            if not args:
                raise ValueError("the model passes its LM head's input by keyword; use loss_chunk_tokens=None")
            seen["hidden"] = args[0]
            return (args[0][..., -1:, :], *args[1:])

        def keep_output(module, args, output):
            seen["raw"] = output

        handles = [self.head.register_forward_pre_hook(keep_input, prepend=True),
                   self.head.register_forward_hook(keep_output, prepend=True)]
        try:
            logits = forward().logits
        finally:
            for handle in handles:
                handle.remove()
        if "hidden" not in seen:
            raise RuntimeError("the model never called its LM head (get_output_embeddings())")
        if not self._checked:
            self._check(seen["raw"], logits)
        if self.fused is not None:
            if split is None:
                return self.fused(*scored_tokens(seen["hidden"], labels, min_rows=1, shifted=shifted))
            return self._fused_by_source(seen["hidden"], labels, split, shifted=shifted)
        return chunked_token_loss_sum(seen["hidden"], labels, self.head, num_chunks=self.num_chunks,
                                      softcap=self.softcap, split=split, shifted=shifted)

    def _fused_by_source(self, hidden: torch.Tensor, labels: torch.Tensor, split: SourceSplit, *,
                         shifted: bool = False) -> torch.Tensor:
        """Liger's loss once per source present, on that source's scored rows: their sum is the
        call's (the sum splits over any partition of the tokens), each part a source's."""
        assert self.fused is not None
        hidden_nh, labels_n, sources_n = _scored(hidden, labels, min_rows=1, split=split, shifted=shifted)
        assert sources_n is not None
        total = None
        for source in split.present:
            rows_n = (sources_n == source).nonzero().squeeze(1)
            if not rows_n.numel():
                continue
            part = self.fused(hidden_nh.index_select(0, rows_n), labels_n.index_select(0, rows_n))
            split.add_total(source, part)
            total = part if total is None else total + part
        return self.fused(hidden_nh, labels_n) if total is None else total

    @torch.no_grad()
    def _check(self, raw: torch.Tensor, logits: torch.Tensor) -> None:
        expected = softcap_logits(raw, self.softcap).float()
        if expected.shape != logits.shape or not torch.allclose(logits.float(), expected, rtol=1e-5, atol=1e-6):
            raise ValueError("this model changes its logits after the LM head in a way odb's chunked loss does not "
                             "know (only final_logit_softcapping is known); use the full-logits loss "
                             "(loss_chunk_tokens=None)")
        self._checked = True


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, split: SourceSplit | None = None, *,
                   shifted: bool = False) -> torch.Tensor:
    """Summed next-token cross entropy of a row batch ``logits [B, T, V]``, ``labels [B, T]``
    (-100 ignored; the shift happens here: logits at t predict labels at t + 1, unless ``shifted``:
    labels already each position's target); ``split`` receives each source's sum of the same
    token losses (or None)."""
    scored = slice(None) if shifted else slice(None, -1)  # the positions whose target is in ``labels``
    targets = labels if shifted else labels[:, 1:]
    losses_n = F.cross_entropy(logits[:, scored].flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                               reduction="sum" if split is None else "none")  # (none: 0 where ignored)
    if split is None:
        return losses_n
    split.add(split.predicted()[:, scored].flatten(), losses_n)
    return losses_n.sum()
