"""The CUDA path of a packed row (fp16/bf16): FlashAttention-3's or flash-attn's varlen kernel where
installed, else torch's ``varlen_attn`` (:mod:`odb.training.attention.kernels`), q, k and v padded
to one head dim where they differ (MLA); None where no installed kernel computes what the call asks
for (the caller runs the grouped path, with a one-time warning).

:func:`attention_path` names the path a device takes, for the start banner, after one tiny packed
call through it checked against SDPA on each sample alone; it raises naming the fix where the
path cannot run."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from odb.training.attention import kernels
from odb.training.attention.explicit import causal_band
from odb.training.attention.semantics import Pattern, calls, warn_slow

__all__ = ["attention_path", "has_flash_attn"]


def has_flash_attn() -> bool:
    """Whether an installed flash kernel (FlashAttention-3 or flash-attn 2) serves odb_varlen on GPU."""
    return bool(kernels.flash_kernels())


_MAX_HEAD_DIM = 256  # every Flash Attention varlen kernel's limit


def _kernel_heads(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v with one head dim, a multiple of 8 (zeros appended: FA2 and torch's kernel need v's
    head dim equal to q's, which MLA's is not, e.g. DeepSeek-V3's 192 and 128; FA3 and torch's do not
    pad to a multiple of 8 themselves); None above 256 (no kernel)."""
    dim = -(-max(q.shape[-1], v.shape[-1]) // 8) * 8
    if dim > _MAX_HEAD_DIM:
        return None
    return tuple(t if t.shape[-1] == dim else F.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))


def cuda_varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scaling, pattern: Pattern) -> torch.Tensor | None:
    """``q, k, v [T, H(kv), D]`` through a Flash Attention varlen kernel; None where no installed
    kernel computes what ``pattern`` asks for (the caller runs the grouped path)."""
    if pattern.sinks:
        warn_slow("no Flash Attention varlen kernel has attention sinks (s_aux)")
        return None
    value_dim = v.shape[-1]
    padded = _kernel_heads(q, k, v)
    if padded is None:
        warn_slow(f"head dim {max(q.shape[-1], value_dim)} is over the Flash Attention kernels' {_MAX_HEAD_DIM}")
        return None
    if padded[0].shape[-1] != q.shape[-1] and scaling is None:  # the kernels' default would read the padded dim
        scaling = q.shape[-1] ** -0.5
    q, k, v = padded
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    for api in kernels.flash_kernels():
        if api.computes(pattern.is_causal, pattern.window, pattern.softcap, pattern.dropout):
            calls[api.counter] += 1
            return api.call(q, k, v, cu, max_seqlen, scale=scaling, is_causal=pattern.is_causal,
                            window=pattern.window, softcap=pattern.softcap, dropout=pattern.dropout)[..., :value_dim]
    if pattern.dropout or pattern.softcap is not None:
        warn_slow("torch's varlen_attn has no dropout and no softcap, and no installed flash kernel computes this call "
                  "(flash-attn >= 2.6 computes either, not softcap with dropout: set attention_dropout 0 for the fused "
                  "kernel)")
        return None
    api = kernels.torch_varlen_api()
    if api is None:
        warn_slow(f"torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not installed "
                  "(torch >= 2.12 or flash-attn for a fused varlen kernel)")
        return None
    out = kernels.call_torch_varlen(api, q, k, v, cu, max_seqlen, scale=scaling, is_causal=pattern.is_causal,
                                    window=pattern.window)
    if out is None:
        warn_slow(f"torch {torch.__version__}'s varlen_attn has no window_size (sliding windows: torch >= 2.11), "
                  "and flash-attn is not installed")
        return None
    calls["torch varlen_attn"] += 1
    return out[..., :value_dim]


# how to uninstall each kernel (FA3's betas installed flash_attn_interface as flashattn-hopper, or as flash_attn)
_UNINSTALL = {"FlashAttention-3": "`pip uninstall flash_attn_3` (a beta: the package that installed "
                                  "flash_attn_interface)", "flash-attn": "`pip uninstall flash-attn`"}
_GROUPED = "SDPA per group of similar-length samples"


# max |out - SDPA| in the start check, by dtype (outputs are averages of values of order 1)
_CHECK_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def attention_path(device: torch.device, dtype: torch.dtype) -> str:
    """The path odb_varlen takes for packed rows on ``device`` in ``dtype``, in words for the start banner (e.g.
    'flash-attn 2.8.3 varlen', 'torch varlen_attn (is_causal; K/V heads expanded)', 'SDPA per group of similar-length
    samples'). On CUDA it runs one tiny packed call through that path and compares it with SDPA on each sample alone.
    Raises RuntimeError naming the fix (the torch or flash-attn version to install, or what to uninstall) when the
    path cannot run (e.g. flash-attn installed but failing to import or to run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _GROUPED
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{_GROUPED} (Flash Attention kernels need fp16/bf16, not {str(dtype).removeprefix('torch.')})"
    return _kernel_path(device, dtype)


def _kernel_path(device: torch.device, dtype: torch.dtype) -> str:
    """:func:`attention_path` for a device whose fp16/bf16 packed rows go to :func:`cuda_varlen_attention`."""
    install = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    errors = kernels.flash_attn_errors()
    if errors:
        package, error = next(iter(errors.items()))
        raise RuntimeError(f"{package} is installed but fails to import ({error}): install its build for "
                           f"{install}, or {_UNINSTALL[package]} (odb then uses the next kernel)")
    flash, api = kernels.flash_kernels(), kernels.torch_varlen_api()
    unused = "".join(f"; {why}" for why in kernels.flash_unused())
    if flash:
        name = flash[0].describe()
        fix = (f"install the {flash[0].package} build for {install} (FlashAttention-3 needs a Hopper GPU), or "
               f"{_UNINSTALL[flash[0].package]} (odb then uses the next kernel)")
    elif api is not None:
        name = api.describe()
        fix = ("install torch >= 2.12 (varlen_attn with scale, window_size and enable_gqa) or flash-attn; on a GPU "
               "older than Ampere (no Flash Attention kernels) train in fp32, which takes the per-group SDPA path")
    else:
        return (f"{_GROUPED} (torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not "
                f"installed: torch >= 2.12 or flash-attn for a fused kernel{unused})")
    try:
        diffs = {f"window {w}" if w else "causal": _check_kernel(device, dtype, w) for w in (None, 4)}
    except Exception as error:  # a kernel not built for this GPU, a signature odb does not know, ...
        raise RuntimeError(f"odb_varlen's CUDA path ({name}) fails on {device} in {dtype}: "
                           f"{type(error).__name__}: {error}; {fix}") from error
    tolerance = _CHECK_TOLERANCE[dtype]
    wrong = {case: diff for case, diff in diffs.items() if diff is not None and not diff <= tolerance}
    if wrong:
        raise RuntimeError(f"odb_varlen's CUDA path ({name}) differs from SDPA on each sample alone on {device} in "
                           f"{dtype}: max abs diff {wrong} > {tolerance}; {fix}")
    return name + unused


def _check_kernel(device: torch.device, dtype: torch.dtype, window: int | None) -> float | None:
    """Max |out - SDPA per sample| of one packed call (4 samples, GQA 4:2, a scale other than
    ``1/sqrt(D)``) through :func:`cuda_varlen_attention`; None where the kernel leaves it to the grouped path."""
    gen = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim, scale = (5, 17, 1, 9), 4, 2, 64, 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(lengths), heads, dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lengths), kv_heads, dim, generator=gen).to(device, dtype) for _ in range(2))
    pattern = Pattern(True, window, None, 0.0)
    with torch.no_grad():
        out = cuda_varlen_attention(q, k, v, cu, max(lengths), scale, pattern)
        if out is None:
            return None
        bounds = cu.tolist()
        expected = []
        for start, end in pairwise(bounds):
            qs, ks, vs = (t[start:end].transpose(0, 1).float()[None] for t in (q, k, v))
            allowed = causal_band(end - start, window, torch.device(device))
            expected.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale,
                                                           enable_gqa=True)[0].transpose(0, 1))
        return float((out.float() - torch.cat(expected)).abs().max())
