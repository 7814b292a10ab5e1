"""odb_varlen's CUDA kernels as the installed releases spell them, on CPU with stand-ins.

The real kernels run on CUDA only. Each stand-in below has the signature of one historical
release of ``torch.nn.attention.varlen.varlen_attn`` (or of flash-attn's varlen function) and
computes what that release computes, sample by sample through SDPA, from the arguments it has
and nothing else (a release without ``scale`` uses ``1/sqrt(D)``; one without ``enable_gqa``
needs as many K/V heads as query heads). odb's call through each must equal odb's own per-group
path; :func:`odb.training.attention.cuda.attention_path`'s start check must name the path, or refuse
a broken one naming the fix.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from odb.training import attention
from odb.training.attention import cuda, grouped
from odb.training.attention import kernels as varlen_kernels
from odb.training.attention.semantics import Pattern

BOUNDS = [0, 9, 10, 31, 38, 64]
SCALE = 0.1  # not 1/sqrt(16): a kernel called without it must be pre-scaled


def _per_sample(q, k, v, cu, left: int, right: int, scale: float | None, gqa: bool) -> torch.Tensor:
    """What a Flash Attention varlen kernel returns: ``[T, H, D]``, key j visible to query i when
    ``(left < 0 or j >= i - left) and (right < 0 or j <= i + right)``."""
    if not gqa:
        assert q.shape[1] == k.shape[1], "this release has no GQA: K/V heads must be expanded"
    out = []
    for start, end in pairwise(cu.tolist()):
        i = torch.arange(end - start)
        allowed = ((left < 0) | (i[None, :] >= i[:, None] - left)) & ((right < 0) | (i[None, :] <= i[:, None] + right))
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale,
                                                  enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(out)


def varlen_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _per_sample(query, key, value, cu_seq_q, -1, 0 if is_causal else -1, None, False)


def varlen_oct_2025(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None,
                    scale=None):
    return _per_sample(query, key, value, cu_seq_q, -1, 0 if is_causal else -1, scale, False)


def varlen_jan_2026(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
    return _per_sample(query, key, value, cu_seq_q, *window_size, scale, False)


def varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return _per_sample(query, key, value, cu_seq_q, *window_size, scale, enable_gqa)


RELEASES = {"2.9": varlen_2_9, "Oct 2025": varlen_oct_2025, "Jan 2026": varlen_jan_2026, "2.12": varlen_2_12}
PATTERNS = {"causal": Pattern(True, None, None, 0.0), "window 5": Pattern(True, 5, None, 0.0),
            "bidirectional": Pattern(False, None, None, 0.0)}


@pytest.fixture
def kernels(monkeypatch):
    """Installs a stand-in: ``kernels(torch_varlen=f, flash=g, flash_error=msg)``."""

    def install(*, torch_varlen=None, flash=None, flash_error=None):
        api = None if torch_varlen is None else varlen_kernels.TorchVarlenApi.of(torch_varlen)
        monkeypatch.setattr(varlen_kernels, "torch_varlen_api", lambda: api)
        monkeypatch.setattr(varlen_kernels, "flash_attn_varlen", lambda: flash)
        monkeypatch.setattr(varlen_kernels, "flash_attn_error", lambda: flash_error)
        return api

    return install


def qkv():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(BOUNDS[-1], 4, 16, generator=gen)
    k, v = (torch.randn(BOUNDS[-1], 2, 16, generator=gen) for _ in range(2))
    return q, k, v, torch.tensor(BOUNDS, dtype=torch.int32)


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_varlen_attn_signature_equals_the_per_group_path(kernels, release):
    """GQA 4:2, a scale other than the default, causal / window / bidirectional: through the
    release's own arguments, or None (the per-group path) where it has no window."""
    api = kernels(torch_varlen=RELEASES[release])
    q, k, v, cu = qkv()
    for name, pattern in PATTERNS.items():
        out = cuda.cuda_varlen_attention(q, k, v, cu, 26, SCALE, pattern)
        if out is None:
            assert pattern.window is not None and not api.has_window, f"{release} {name}: no kernel call"
            continue
        expected = grouped.grouped_varlen(q, k, v, cu, SCALE, pattern, None)
        diff = float((out - expected).abs().max())
        print(f"{release} ({api.describe()}), {name}: max abs diff {diff:.1e}")
        assert diff <= 1e-5, f"{release}, {name}: off the per-group path by {diff:.1e}"


def test_the_descriptions_name_what_odb_does_for_each_release():
    described = {name: varlen_kernels.TorchVarlenApi.of(f).describe() for name, f in RELEASES.items()}
    print(described)
    assert described == {
        "2.9": "torch varlen_attn (is_causal: sliding windows per group; q pre-scaled; K/V heads expanded)",
        "Oct 2025": "torch varlen_attn (is_causal: sliding windows per group; K/V heads expanded)",
        "Jan 2026": "torch varlen_attn (window_size; K/V heads expanded)",
        "2.12": "torch varlen_attn (window_size)"}
    installed = varlen_kernels.torch_varlen_api()  # the real one (torch >= 2.12 here)
    assert installed is not None and installed.has_window and installed.has_scale and installed.has_gqa


def test_what_no_kernel_computes_falls_to_the_per_group_path(kernels):
    """Dropout, softcap and sinks without flash-attn; sinks with it too (flash-attn 2.x has none);
    no varlen module at all (torch < 2.9)."""
    q, k, v, cu = qkv()
    kernels(torch_varlen=varlen_2_12)
    for pattern in (Pattern(True, None, None, 0.1), Pattern(True, None, 1.0, 0.0), Pattern(True, None, None, 0.0,
                                                                                               sinks=True)):
        assert cuda.cuda_varlen_attention(q, k, v, cu, 26, SCALE, pattern) is None
    kernels(torch_varlen=varlen_2_12, flash=lambda *a, **kw: pytest.fail("flash-attn called for sinks"))
    assert cuda.cuda_varlen_attention(q, k, v, cu, 26, SCALE, Pattern(True, None, None, 0.0, sinks=True)) is None
    kernels(torch_varlen=None)
    assert cuda.cuda_varlen_attention(q, k, v, cu, 26, SCALE, PATTERNS["causal"]) is None


def test_attention_path_names_the_path_after_a_checked_call(kernels):
    """The start check (``_kernel_path``: what :func:`attention_path` runs on CUDA), here on the
    CPU in fp32 with each release standing in; CPU itself: the grouped path, no check."""
    assert attention.attention_path(torch.device("cpu"), torch.bfloat16) == "SDPA per group of similar-length samples"
    assert "fp16/bf16" in attention.attention_path(torch.device("cuda"), torch.float32)
    for release, function in RELEASES.items():
        kernels(torch_varlen=function)
        assert cuda._kernel_path(torch.device("cpu"), torch.float32) == \
            varlen_kernels.TorchVarlenApi.of(function).describe(), release
    kernels(torch_varlen=None)
    assert "no torch.nn.attention.varlen" in cuda._kernel_path(torch.device("cpu"), torch.float32)


def test_attention_path_refuses_a_path_that_cannot_run(kernels):
    """flash-attn installed but failing to import; a kernel that raises; a kernel that computes
    something else (the scale dropped): each a RuntimeError naming the fix."""
    kernels(torch_varlen=varlen_2_12, flash_error="ImportError: undefined symbol _ZN3c10")
    with pytest.raises(RuntimeError, match="pip uninstall flash-attn"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)

    def broken(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    kernels(torch_varlen=broken)
    with pytest.raises(RuntimeError, match=r"fails on cpu.*Ampere.*torch >= 2.12"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)

    def scale_ignored(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False):
        return _per_sample(query, key, value, cu_seq_q, *window_size, None, enable_gqa)

    kernels(torch_varlen=scale_ignored)
    with pytest.raises(RuntimeError, match="differs from SDPA on each sample alone"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
              window_size=(-1, -1), softcap=0.0):
        return _per_sample(q, k, v, cu_q, *window_size, softmax_scale, True)

    kernels(torch_varlen=varlen_2_12, flash=flash)
    assert cuda._kernel_path(torch.device("cpu"), torch.float32).startswith("flash-attn ")
