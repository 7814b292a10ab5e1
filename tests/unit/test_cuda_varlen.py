"""odb_varlen's CUDA call sites against every supported kernel release, on CPU with stand-ins.

The real kernels run on CUDA only. Each stand-in (tests/cuda_standin.standin) has the header of
one release as released (tests/fixtures/kernel_signatures.py: flash-attn 2.6.3 / 2.7.4 / 2.8.3,
FlashAttention-3's betas and 2.8.3, torch 2.10 / 2.11 / 2.12+), binds odb's call as that release
would (a keyword it lacks raises), checks the inputs as its kernel does (int32 contiguous
cu_seqlens, one head dim, Python int lengths, GQA heads) and computes what the kernel documents,
sample by sample (tests/cuda_standin.flash_reference). odb's call through each must equal odb's
own per-group path, or leave the call to it exactly where the release cannot compute it; the
start-up probe (:func:`odb.training.attention.cuda.attention_path`) must name the path and, where a
release lacks something, the upgrade; a path that cannot run must stop naming the fix.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cuda_standin import kernel_calls, standin
from fixtures.kernel_signatures import RELEASES
from odb.training import attention
from odb.training.attention import cuda, grouped
from odb.training.attention import kernels as varlen_kernels
from odb.training.attention.semantics import Pattern, calls

BOUNDS = [0, 9, 10, 31, 38, 64]
MAX_SEQLEN = 26  # the longest sample's (a kernel given less leaves rows unwritten: the stand-ins refuse it)
SCALE = 0.1  # not 1/sqrt(D): a kernel called without it must be pre-scaled
PATTERNS = {"causal": Pattern(True, None, None, 0.0), "window 5": Pattern(True, 5, None, 0.0),
            "bidirectional": Pattern(False, None, None, 0.0), "softcap": Pattern(True, 5, 2.0, 0.0)}
INSTALLED = varlen_kernels.torch_varlen_api()  # (before any test patches it)
# q/k head dim, v head dim: a plain one, MLA's (v narrower), v wider, one that is not a multiple of 8
HEAD_DIMS = {"D 16": (16, 16), "MLA 24/16": (24, 16), "v wider 16/24": (16, 24), "D 20": (20, 20)}


def installed(monkeypatch, *names: str, flash_errors: dict | None = None) -> None:
    """Only the stand-ins of ``names`` are installed (at most one torch release)."""
    flash = tuple(varlen_kernels.FlashApi.of(standin(RELEASES[n]), RELEASES[n].kernel, RELEASES[n].version)
                  for n in names if RELEASES[n].kernel != "torch")
    torch_api = [varlen_kernels.TorchVarlenApi.of(standin(RELEASES[n])) for n in names if RELEASES[n].kernel == "torch"]
    monkeypatch.setattr(varlen_kernels, "_flash_imports", lambda: (flash, flash_errors or {}))
    monkeypatch.setattr(varlen_kernels, "torch_varlen_api", lambda: torch_api[0] if torch_api else None)


def qkv(dims=(16, 16)):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(BOUNDS[-1], 4, dims[0], generator=gen)
    k = torch.randn(BOUNDS[-1], 2, dims[0], generator=gen)
    v = torch.randn(BOUNDS[-1], 2, dims[1], generator=gen)
    return q, k, v, torch.tensor(BOUNDS, dtype=torch.int32)


def computes(release, pattern: Pattern) -> bool:
    """What the release's header says it computes (read here from its text, not through odb)."""
    header = release.header
    if not release.backward:
        return False
    if pattern.softcap is not None and "softcap" not in header:
        return False
    return pattern.window is None or "window_size" in header


@pytest.mark.parametrize("release", list(RELEASES))
def test_each_release_computes_what_the_per_group_path_does(monkeypatch, release):
    """GQA 4:2, a scale other than the default, causal / window / bidirectional / softcap, MLA's and
    odd head dims: through the release's own arguments, or None (the per-group path) exactly where
    the release cannot compute the pattern. Every call binds to the release's header and passes
    its kernel's input checks (the stand-in raises otherwise)."""
    installed(monkeypatch, release)
    for (dims_name, dims), scale in itertools.product(HEAD_DIMS.items(), (SCALE, None)):  # None: the model's 1/sqrt(D)
        q, k, v, cu = qkv(dims)
        for name, pattern in PATTERNS.items():
            kernel_calls.clear()
            out = cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, scale, pattern)
            expected_kernel = computes(RELEASES[release], pattern) and (
                pattern.softcap is None or RELEASES[release].kernel != "torch")
            if not expected_kernel:
                assert out is None and not kernel_calls, f"{release} {name}: called a kernel that cannot compute it"
                continue
            assert out is not None, f"{release} {name} {dims_name}: no kernel call"
            expected = grouped.grouped_varlen(q, k, v, cu, scale, pattern, None)
            diff = float((out - expected).abs().max())
            call, = kernel_calls
            print(f"{release}, {name}, {dims_name}, scale {scale}: max abs diff {diff:.1e}; kernel saw q {call['q']} "
                  f"v {call['v']}")
            assert out.shape == expected.shape and diff <= 1e-5, f"{release}, {name}, {dims_name}: off by {diff:.1e}"
            assert call["q"][-1] == call["v"][-1] and call["q"][-1] % 8 == 0, call


def test_the_probe_names_each_release_and_the_upgrade_it_lacks(monkeypatch):
    """The start banner's words for each release (``_kernel_path``, run here on the CPU in fp32)."""
    named = {}
    for release in RELEASES:
        installed(monkeypatch, release)
        named[release] = cuda._kernel_path(torch.device("cpu"), torch.float32)
    print(named)
    missing = "no dropout: the next kernel or per group"
    assert named == {
        "flash-attn 2.6.3": "flash-attn 2.6.3 varlen",
        "flash-attn 2.7.4.post1": "flash-attn 2.7.4.post1 varlen",
        "flash-attn 2.8.3": "flash-attn 2.8.3 varlen",
        "FlashAttention-3 beta (2.6.3)": f"SDPA per group of similar-length samples (torch {torch.__version__} has no "
        "torch.nn.attention.varlen and flash-attn is not installed: torch >= 2.12 or flash-attn for a fused kernel; "
        "FlashAttention-3 beta (2.6.3) is the first beta (no varlen backward, no window_size): build flash_attn_3 "
        "from flash-attention >= 2.8 (hopper/), or uninstall it)",
        "FlashAttention-3 beta (2.7.4)": f"FlashAttention-3 beta (2.7.4) varlen ({missing})",
        "FlashAttention-3 (2.8.3)": f"FlashAttention-3 2.8.3 varlen ({missing})",
        "torch 2.10": "torch varlen_attn (is_causal: sliding windows per group; q pre-scaled; K/V heads expanded; "
                      "torch >= 2.12 takes windows, scale, GQA in the kernel)",
        "torch 2.11": "torch varlen_attn (window_size; K/V heads expanded; torch >= 2.12 takes GQA in the kernel)",
        "torch 2.12": "torch varlen_attn (window_size)"}
    if torch.__version__ >= "2.12":  # the real one here (CI: 2.13)
        assert INSTALLED is not None and INSTALLED.describe() == named["torch 2.12"]
    assert attention.attention_path(torch.device("cpu"), torch.bfloat16) == "SDPA per group of similar-length samples"
    assert "fp16/bf16" in attention.attention_path(torch.device("cuda"), torch.float32)


def test_with_several_kernels_each_call_takes_the_first_that_computes_it(monkeypatch):
    """FlashAttention-3, flash-attn and torch installed: FA3 takes what it computes, dropout goes
    to flash-attn (FA3 has none), and nothing reaches torch's; sinks reach no kernel."""
    installed(monkeypatch, "FlashAttention-3 (2.8.3)", "flash-attn 2.8.3", "torch 2.12")
    q, k, v, cu = qkv()
    calls.clear()
    kernel_calls.clear()
    for pattern in (*PATTERNS.values(), Pattern(True, None, None, 0.1)):
        assert cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, SCALE, pattern) is not None
    sinks = Pattern(True, None, None, 0.0, sinks=True)
    assert cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, SCALE, sinks) is None
    print([(c["kernel"], c["dropout"]) for c in kernel_calls])
    assert [c["kernel"] for c in kernel_calls] == ["FlashAttention-3 2.8.3"] * 4 + ["flash-attn 2.8.3"]
    assert kernel_calls[-1]["dropout"] == 0.1
    assert calls == {"flash-attn 3 varlen": 4, "flash-attn varlen": 1}


def test_what_no_kernel_computes_falls_to_the_per_group_path(monkeypatch):
    """Dropout, softcap and sinks with torch's kernel alone; sinks with flash-attn too, and softcap
    with dropout (flash-attn 2 refuses both at once; FA3 has no dropout); head dims over 256; no
    varlen module at all (torch 2.9)."""
    q, k, v, cu = qkv()
    installed(monkeypatch, "FlashAttention-3 (2.8.3)", "flash-attn 2.8.3", "torch 2.12")
    kernel_calls.clear()
    assert cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, SCALE, Pattern(True, None, 1.0, 0.1)) is None
    assert not kernel_calls
    installed(monkeypatch, "torch 2.12")
    for pattern in (Pattern(True, None, None, 0.1), Pattern(True, None, 1.0, 0.0), Pattern(True, None, None, 0.0,
                                                                                               sinks=True)):
        assert cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, SCALE, pattern) is None
    installed(monkeypatch, "flash-attn 2.8.3", "torch 2.12")
    kernel_calls.clear()
    sinks = Pattern(True, None, None, 0.0, sinks=True)
    assert cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, SCALE, sinks) is None
    wide = torch.zeros(BOUNDS[-1], 2, 264)
    assert cuda.cuda_varlen_attention(wide, wide, wide, cu, MAX_SEQLEN, SCALE, PATTERNS["causal"]) is None
    assert not kernel_calls
    installed(monkeypatch)
    assert cuda.cuda_varlen_attention(q, k, v, cu, MAX_SEQLEN, SCALE, PATTERNS["causal"]) is None


def test_attention_path_refuses_a_path_that_cannot_run(monkeypatch):
    """flash-attn or FlashAttention-3 installed but failing to import; a kernel that raises; a kernel
    that computes something else (the scale dropped): each a RuntimeError naming the fix."""
    installed(monkeypatch, "torch 2.12", flash_errors={"flash-attn": "ImportError: undefined symbol _ZN3c10"})
    with pytest.raises(RuntimeError, match=r"flash-attn is installed but fails.*pip uninstall flash-attn"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)
    installed(monkeypatch, "torch 2.12", flash_errors={"FlashAttention-3": "ImportError: libcudart.so.13"})
    with pytest.raises(RuntimeError, match=r"FlashAttention-3 is installed but fails.*pip uninstall flash_attn_3"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)

    def broken(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    monkeypatch.setattr(varlen_kernels, "_flash_imports", lambda: ((), {}))
    monkeypatch.setattr(varlen_kernels, "torch_varlen_api", lambda: varlen_kernels.TorchVarlenApi.of(broken))
    with pytest.raises(RuntimeError, match=r"fails on cpu.*Ampere.*torch >= 2.12"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)

    torch_2_12 = standin(RELEASES["torch 2.12"])

    def scale_ignored(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False):
        return torch_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                          enable_gqa=enable_gqa)

    monkeypatch.setattr(varlen_kernels, "torch_varlen_api", lambda: varlen_kernels.TorchVarlenApi.of(scale_ignored))
    with pytest.raises(RuntimeError, match="differs from SDPA on each sample alone"):
        cuda._kernel_path(torch.device("cpu"), torch.float32)
