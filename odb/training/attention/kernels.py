"""The Flash Attention varlen kernels odb_varlen calls on CUDA, as the installed releases spell them.

Two kernels can serve a packed row on CUDA in fp16/bf16 (q, k, v shaped ``[T, H(kv), D]``, samples
given by ``cu_seqlens``):

* the flash-attn package's ``flash_attn_varlen_func`` (optional; dropout, windows, softcap; its
  2.x releases have no attention sinks);
* PyTorch's ``torch.nn.attention.varlen.varlen_attn``, whose signature moved across releases::

      2.9        varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)
      Oct 2025   ... is_causal=False, return_aux=None, scale=None
      Jan 2026   ... *, return_aux=None, scale=None, window_size=(-1, -1)   (is_causal deprecated)
      2.12       ... *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, ...

  (which of the middle two torch 2.10 and 2.11 ship is not verified here: it does not matter).
  :func:`torch_varlen_api` reads the installed one once (``inspect.signature``) and
  :func:`call_torch_varlen` calls it with what it has: ``window_size`` where it exists, else
  ``is_causal`` (a sliding window then has no kernel: None, the caller's grouped path runs it);
  ``scale`` where it exists, else q pre-scaled by ``scale * sqrt(D)`` (the kernel's own scale is
  ``1 / sqrt(D)``, so ``softmax(q' k^T / sqrt(D)) = softmax(scale q k^T)``); ``enable_gqa`` where
  it exists, else K/V heads expanded (``repeat_interleave``: query head h reads K/V head
  ``h // (H / H_kv)``, as transformers' ``repeat_kv``). No such module (torch < 2.9): None.

Window convention (both kernels): query i sees keys ``i - left .. i + right`` (-1: no limit);
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

__all__ = ["TorchVarlenApi", "call_torch_varlen", "flash_attn_error", "flash_attn_varlen", "flash_attn_version",
           "flash_window", "torch_varlen_api"]


def flash_window(is_causal: bool, window: int | None) -> tuple[int, int]:
    """Flash Attention's ``(left, right)`` for a causal (optionally windowed) or bidirectional call."""
    if not is_causal:
        return -1, -1
    return (window - 1 if window is not None else -1), 0


@lru_cache(maxsize=1)
def _flash_attn_import() -> tuple[Callable | None, str | None]:
    """(flash-attn's varlen kernel, None), (None, None) when not installed, or (None, why the
    installed package fails to import). Looked up once: Python does not cache a failed import."""
    if importlib.util.find_spec("flash_attn") is None:
        return None, None
    try:  # softcap needs flash-attn >= 2.6
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # a build for another torch or CUDA fails with OSError/ImportError/...
        return None, f"{type(error).__name__}: {error}"
    return flash_attn_varlen_func, None


def flash_attn_varlen() -> Callable | None:
    """flash-attn's ``flash_attn_varlen_func``, or None (not installed, or failing to import)."""
    return _flash_attn_import()[0]


def flash_attn_error() -> str | None:
    """Why an installed flash-attn fails to import, or None."""
    return _flash_attn_import()[1]


def flash_attn_version() -> str:
    try:
        return importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return "?"


@dataclass(frozen=True)
class TorchVarlenApi:
    """What the installed ``varlen_attn`` accepts (its keyword arguments, read from its signature)."""

    function: Callable
    has_window: bool  # window_size=(left, right)
    has_is_causal: bool  # is_causal= (2.9, 2.10)
    has_scale: bool
    has_gqa: bool  # enable_gqa=

    @classmethod
    def of(cls, function: Callable) -> TorchVarlenApi:
        names = set(inspect.signature(function).parameters)
        return cls(function, has_window="window_size" in names, has_is_causal="is_causal" in names,
                   has_scale="scale" in names, has_gqa="enable_gqa" in names)

    def describe(self) -> str:
        """E.g. 'torch varlen_attn (is_causal; K/V heads expanded)'."""
        notes = ["window_size" if self.has_window else "is_causal: sliding windows per group"]
        if not self.has_scale:
            notes.append("q pre-scaled")
        if not self.has_gqa:
            notes.append("K/V heads expanded")
        return f"torch varlen_attn ({'; '.join(notes)})"


@lru_cache(maxsize=1)
def torch_varlen_api() -> TorchVarlenApi | None:
    """The installed ``torch.nn.attention.varlen.varlen_attn``, probed once; None before torch 2.9."""
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
