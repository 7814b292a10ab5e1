"""The Flash Attention varlen kernels odb_varlen calls on CUDA, as the installed releases spell them.

Three kernels can serve a packed row on CUDA in fp16/bf16 (q, k, v shaped ``[T, H(kv), D]``,
samples given by int32 ``cu_seqlens``), tried in this order:

* FlashAttention-3 (Hopper), module ``flash_attn_interface`` (package ``flash_attn_3``, built from
  flash-attention's ``hopper/``): windows and softcap, no dropout, no attention sinks;
* the flash-attn package's ``flash_attn_varlen_func`` (2.x): dropout, windows, softcap (>= 2.6), no sinks;
* PyTorch's ``torch.nn.attention.varlen.varlen_attn``: windows (2.11+), no dropout, softcap or sinks.

Their signatures, read from the released sources (tests/fixtures/kernel_signatures.py holds them
verbatim, each release's call tested against its own)::

    flash-attn 2.6.3 .. 2.8.3   (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, ...)  -> out
    FA3 beta (flash-attn 2.6.3) (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                                 causal=False)  -> (out, lse), and no varlen backward: not used
    FA3 beta (flash-attn 2.7.4) (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale=None, causal=False, ..., window_size=(-1, -1), ...,
                                 softcap=0.0, ...)  -> (out, lse)
    FA3 (flash-attn 2.8.3 on)   (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                                 seqused_k=None, softmax_scale=None, causal=False, ..., window_size=(-1, -1), ...,
                                 softcap=0.0, ...)  -> out (or (out, lse) with return_attn_probs)
    torch 2.9                   no torch.nn.attention.varlen
    torch 2.10                  varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                                            return_aux=None)
    torch 2.11                  ... max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    torch 2.12 on               ... *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, ...

:class:`FlashApi` and :class:`TorchVarlenApi` read the installed one once (``inspect.signature``)
and call it with what it has, by keyword after q, k, v (FA3 2.7.4's required ``seqused_*`` sit
before ``max_seqlen_*``): a flash kernel without ``dropout_p`` or ``softcap`` does not take a call
that needs them (the next kernel, or the grouped path, does); torch's ``window_size`` where it
exists, else ``is_causal`` (a sliding window then has no kernel); ``scale`` where it exists, else q
pre-scaled by ``scale * sqrt(D)`` (the kernel's own scale is ``1 / sqrt(D)``); ``enable_gqa``
where it exists, else K/V heads expanded (``repeat_interleave``: query head h reads K/V head
``h // (H / H_kv)``, as transformers' ``repeat_kv``); the flash kernels read GQA heads in place.
A tuple result (FA3's betas) gives its first element.

Window convention (every kernel): query i sees keys ``i - left .. i + right`` (-1: no limit);
transformers' sliding window w keeps ``i - w < j <= i``, so ``left = w - 1`` (:func:`flash_window`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["FlashApi", "TorchVarlenApi", "call_torch_varlen", "flash_attn_errors", "flash_attn_version",
           "flash_kernels", "flash_unused", "flash_window", "torch_varlen_api"]


def flash_window(is_causal: bool, window: int | None) -> tuple[int, int]:
    """Flash Attention's ``(left, right)`` for a causal (optionally windowed) or bidirectional call."""
    if not is_causal:
        return -1, -1
    return (window - 1 if window is not None else -1), 0


# (import name, package on the index, what odb calls it), in the order odb tries them
_FLASH_MODULES = (("flash_attn_interface", "flash_attn_3", "FlashAttention-3"),
                  ("flash_attn", "flash_attn", "flash-attn"))


@dataclass(frozen=True)
class FlashApi:
    """What an installed flash-attn or FlashAttention-3 ``flash_attn_varlen_func`` accepts (read
    from its signature)."""

    function: Callable
    package: str  # 'flash-attn' or 'FlashAttention-3'
    version: str
    has_dropout: bool  # dropout_p= (flash-attn 2.x; no FA3)
    has_softcap: bool  # softcap= (flash-attn >= 2.6, FA3 from 2.7.4)
    has_window: bool  # window_size= (flash-attn 2.x; FA3 from 2.7.4)
    seqused: bool  # seqused_q= / seqused_k= (FA3: passed None)

    @classmethod
    def of(cls, function: Callable, package: str, version: str = "?") -> FlashApi:
        names = set(inspect.signature(function).parameters)
        return cls(function, package, version, has_dropout="dropout_p" in names, has_softcap="softcap" in names,
                   has_window="window_size" in names, seqused="seqused_q" in names)

    @property
    def counter(self) -> str:
        """Its key in :data:`odb.training.attention.semantics.calls`."""
        return "flash-attn 3 varlen" if self.package == "FlashAttention-3" else "flash-attn varlen"

    def unusable(self) -> str | None:
        """Why odb does not train through it, or None: FA3's first beta has no varlen backward
        (its gradients are None) and no windows."""
        if self.package == "FlashAttention-3" and not self.has_window:
            return (f"{self.package} {self.version} is the first beta (no varlen backward, no window_size): build "
                    "flash_attn_3 from flash-attention >= 2.8 (hopper/), or uninstall it")
        return None

    def computes(self, is_causal: bool, window: int | None, softcap: float | None, dropout: float) -> bool:
        """Whether it computes the call (flash-attn 2 refuses softcap with dropout: "Softcapping does
        not support dropout for now")."""
        return ((not dropout or self.has_dropout) and (softcap is None or self.has_softcap)
                and (window is None or self.has_window) and not (softcap is not None and dropout))

    def describe(self) -> str:
        """E.g. 'flash-attn 2.8.3 varlen', 'FlashAttention-3 3.0.0 varlen (no dropout: flash-attn 2 or per group)'."""
        missing = [name for name, has in (("dropout", self.has_dropout), ("softcap", self.has_softcap)) if not has]
        note = f" (no {' or '.join(missing)}: the next kernel or per group)" if missing else ""
        return f"{self.package} {self.version} varlen{note}"

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int, *,
             scale: float | None, is_causal: bool, window: int | None, softcap: float | None,
             dropout: float) -> torch.Tensor:
        kwargs = {"softmax_scale": scale, "causal": is_causal}
        if self.has_window:
            kwargs["window_size"] = flash_window(is_causal, window)
        if softcap is not None:
            kwargs["softcap"] = softcap
        if dropout:
            kwargs["dropout_p"] = dropout
        if self.seqused:
            kwargs.update(seqused_q=None, seqused_k=None)
        out = self.function(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                            max_seqlen_k=max_seqlen, **kwargs)
        return out[0] if isinstance(out, tuple) else out


@lru_cache(maxsize=1)
def _flash_imports() -> tuple[tuple[FlashApi, ...], dict[str, str]]:
    """The installed flash kernels (:data:`_FLASH_MODULES` order) and, by package, why an
    installed one fails to import. Looked up once: Python does not cache a failed import."""
    found, errors = [], {}
    for module, distribution, package in _FLASH_MODULES:
        if importlib.util.find_spec(module) is None:
            continue
        try:
            function = importlib.import_module(module).flash_attn_varlen_func
        except Exception as error:  # a build for another torch or CUDA fails with OSError/ImportError/...
            errors[package] = f"{type(error).__name__}: {error}"
            continue
        found.append(FlashApi.of(function, package, _version(distribution)))
    return tuple(found), errors


def flash_kernels() -> tuple[FlashApi, ...]:
    """The installed flash kernels odb trains through, in the order it tries them."""
    return tuple(api for api in _flash_imports()[0] if api.unusable() is None)


def flash_unused() -> list[str]:
    """Why an installed flash kernel is not used (:meth:`FlashApi.unusable`), one line each."""
    return [why for api in _flash_imports()[0] if (why := api.unusable()) is not None]


def flash_attn_errors() -> dict[str, str]:
    """Why an installed flash kernel fails to import, by package ('flash-attn', 'FlashAttention-3')."""
    return _flash_imports()[1]


def flash_attn_version() -> str:
    return _version("flash_attn")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@dataclass(frozen=True)
class TorchVarlenApi:
    """What the installed ``varlen_attn`` accepts (its keyword arguments, read from its signature)."""

    function: Callable
    has_window: bool  # window_size=(left, right)
    has_is_causal: bool  # is_causal= (2.10)
    has_scale: bool
    has_gqa: bool  # enable_gqa=

    @classmethod
    def of(cls, function: Callable) -> TorchVarlenApi:
        names = set(inspect.signature(function).parameters)
        return cls(function, has_window="window_size" in names, has_is_causal="is_causal" in names,
                   has_scale="scale" in names, has_gqa="enable_gqa" in names)

    def describe(self) -> str:
        """E.g. 'torch varlen_attn (window_size; K/V heads expanded; torch >= 2.12 takes GQA in the kernel)'."""
        notes = ["window_size" if self.has_window else "is_causal: sliding windows per group"]
        if not self.has_scale:
            notes.append("q pre-scaled")
        if not self.has_gqa:
            notes.append("K/V heads expanded")
        missing = [what for what, has in (("windows", self.has_window), ("scale", self.has_scale),
                                          ("GQA", self.has_gqa)) if not has]
        if missing:
            notes.append(f"torch >= 2.12 takes {', '.join(missing)} in the kernel")
        return f"torch varlen_attn ({'; '.join(notes)})"


@lru_cache(maxsize=1)
def torch_varlen_api() -> TorchVarlenApi | None:
    """The installed ``torch.nn.attention.varlen.varlen_attn``, probed once; None before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return TorchVarlenApi.of(varlen_attn)


def call_torch_varlen(api: TorchVarlenApi, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                      max_seqlen: int, *, scale: float | None, is_causal: bool,
                      window: int | None) -> torch.Tensor | None:
    """``q, k, v [T, H(kv), D]`` -> ``[T, H, D]`` through ``api``; None where it cannot compute
    the pattern (a sliding window without ``window_size``)."""
    kwargs = {}
    if api.has_window:
        kwargs["window_size"] = flash_window(is_causal, window)
    elif api.has_is_causal and window is None:
        kwargs["is_causal"] = is_causal
    else:
        return None
    if scale is not None:
        if api.has_scale:
            kwargs["scale"] = scale
        else:  # the kernel scales by 1 / sqrt(D)
            q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if api.has_gqa:
            kwargs["enable_gqa"] = True
        else:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return api.function(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
