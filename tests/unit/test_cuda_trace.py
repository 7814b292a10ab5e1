"""odb's packed forward and loss on the CUDA branch, traced on the CPU (tests/cuda_standin.py):
tiny Qwen2 (a sliding-window layer), Gemma-2 (windows, soft-capping), gpt-oss (sinks, windows,
experts), Qwen2-VL (its vision tower's bidirectional calls, M-RoPE) and DeepSeek-V3 (MLA: value
heads narrower than q's) in bf16 on "cuda", through odb's engine (collate, device moves, the
chunked loss's CUDA branch), with each kernel odb can meet: the installed torch's own ``varlen_attn`` (its
Python layers run; the aten flash forward stands in), and stand-ins with the headers of flash-attn
2.8.3, FlashAttention-3 2.8.3 and torch 2.11 (the GPU image's). Every kernel call is checked as the
kernel checks it (bf16, int32 contiguous ``cu_seqlens``, one head dim, Python int lengths, GQA)
and recorded: the windows each layer asked for, the vision tower's bidirectional calls, MLA's
padded heads. The oracle: the model's own eager attention and loss on each sample alone (fp32,
CPU): each sample's summed loss within bf16's error. What this cannot prove (no autograd, no
streams or NCCL): docs/contributing.md, "The CUDA path without a GPU"."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
from test_attention import MOE_FAMILIES, TEXT_FAMILIES, WINDOW, labelled, own_loss_sum, pair, text_samples, vl_samples

from cuda_standin import kernel_calls, liger_calls, liger_standin, on_cuda, standin
from fixtures.kernel_signatures import LIGER_INIT, RELEASES
from odb.training.attention import kernels
from odb.training.attention.semantics import calls
from odb.training.backends import LocalBackend
from odb.training.step.engine import OdbEngine

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              # a CUDA build of torch takes a real device guard for "cuda" tensors: the CPU build (CI's) traces
              pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of torch; on a GPU, "
                                 "tools/check/gpu_check.sh runs the real kernels")]

MLA = {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
       "qk_nope_head_dim": 16, "v_head_dim": 16, "rope_interleave": False, "first_k_dense_replace": 1,
       "num_key_value_heads": 4, "head_dim": 8}
FAMILIES = {"qwen2": TEXT_FAMILIES["qwen2"], "gemma2": TEXT_FAMILIES["gemma2"], "gpt_oss": MOE_FAMILIES["gpt_oss"],
            "qwen2_vl": None, "deepseek_v3": MLA}
KERNELS = ("installed torch", "flash-attn 2.8.3", "FlashAttention-3 (2.8.3)", "torch 2.11")
# each sample's summed loss, relative to the oracle's (bf16 weights and activations against fp32: measured
# 3.6e-4 to 1.2e-3; a scale off by 2x, or a causal model run bidirectional, moves it past 1e-2)
BF16_RTOL = 4e-3


@pytest.fixture
def kernel(monkeypatch, request):
    """Installs one kernel: torch's own (as installed) or a release's stand-in."""
    name = request.param
    flash = ()
    if name != "installed torch":
        release = RELEASES[name]
        if release.kernel == "torch":
            monkeypatch.setattr(kernels, "torch_varlen_api", lambda: kernels.TorchVarlenApi.of(standin(release)))
        else:
            flash = (kernels.FlashApi.of(standin(release), release.kernel, release.version),)
    monkeypatch.setattr(kernels, "_flash_imports", lambda: (flash, {}))
    return name


def build_pair(family: str):
    if family == "deepseek_v3":
        TEXT_FAMILIES.setdefault("deepseek_v3", MLA)  # (test_attention's builder reads its families)
    # Gemma-2's scale from query_pre_attn_scalar 32, not its head dim's 16: a kernel left at its default is seen
    return pair(family, **({"query_pre_attn_scalar": 32} if family == "gemma2" else {}))


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cuda_branch_of_a_packed_forward_and_loss(family, kernel):
    packed, oracle = build_pair(family)
    samples = labelled(vl_samples() if family == "qwen2_vl" else text_samples())
    with torch.no_grad():
        alone = torch.stack([own_loss_sum(oracle, sample) for sample in samples])
    calls.clear()
    kernel_calls.clear()
    with on_cuda() as cuda:
        model = packed.to(device=cuda, dtype=torch.bfloat16)
        engine = OdbEngine(LocalBackend(model, device=cuda), world_size=1, max_tokens=4096, pad_token_id=0)
        engine.router_loss = None
        per_sample, _ = engine.forward_loss(samples, False, per_sample=True)
        assert per_sample.is_cuda and next(model.parameters()).is_cuda
        per_sample = per_sample.inner.float()
    worst = float(((per_sample - alone).abs() / alone.abs().clamp(min=1.0)).max())
    windows = sorted({call["window"] for call in kernel_calls})
    print(f"{family} via {kernel}: paths {dict(calls)}, kernel windows {windows}, "
          f"heads {sorted({(c['q'][-1], c['v'][-1]) for c in kernel_calls})}, worst relative loss diff {worst:.1e}")
    assert worst <= BF16_RTOL, f"{family} via {kernel}: a sample's loss off its own by {worst:.1e}"
    assert all(call["dtype"] == torch.bfloat16 for call in kernel_calls)

    flash = kernel in RELEASES and RELEASES[kernel].kernel != "torch"
    sinks_or_softcap = family == "gpt_oss" or (family == "gemma2" and not flash)
    if sinks_or_softcap:  # no kernel has sinks; torch's has no softcap: every layer per group
        assert not kernel_calls and set(calls) == {"grouped SDPA"}
        return
    assert "grouped SDPA" not in calls and kernel_calls, dict(calls)
    expected = {(WINDOW - 1, 0), (-1, 0)} if family in ("qwen2", "gemma2") else {(-1, 0)}
    if family == "qwen2_vl":
        expected.add((-1, -1))  # the vision tower: bidirectional over each image
    if kernel == "installed torch":  # torch's own layer passes aten the window as given
        assert {c["window"] for c in kernel_calls} == expected
    else:
        assert set(windows) == expected
    scales = {module.scaling for module in packed.modules() if hasattr(module, "scaling")}  # the layers' own
    assert {c["scale"] for c in kernel_calls} == scales, f"kernel scales {[c['scale'] for c in kernel_calls]}"
    if family == "gemma2":
        assert {c["softcap"] for c in kernel_calls} == {1.0} and scales == {32 ** -0.5}
    if family == "deepseek_v3":  # q/k 24, v 16: v padded to q's 24, the output cut back
        assert {(c["q"][-1], c["v"][-1]) for c in kernel_calls} == {(24, 24)}


@pytest.mark.parametrize("release", list(LIGER_INIT))
def test_the_fused_loss_on_cuda_through_each_liger_release(monkeypatch, release):
    """Where liger-kernel is installed, odb's loss on CUDA is its fused linear cross entropy: odb's
    settings bind to each release's header (0.5.10, 0.6.0, 0.8.5), its call passes the scored tokens
    only, and the loss is the model's own on each sample alone (Gemma-2: the final logit soft-cap
    passed as Liger's ``softcap``)."""
    transformers_module = types.ModuleType("liger_kernel.transformers")
    transformers_module.LigerFusedLinearCrossEntropyLoss = liger_standin(LIGER_INIT[release])
    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    package.transformers = transformers_module
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_module)
    packed, oracle = pair("gemma2", final_logit_softcapping=30.0)
    samples = labelled(text_samples())
    with torch.no_grad():
        alone = sum(float(own_loss_sum(oracle, sample)) for sample in samples)
    liger_calls.clear()
    with on_cuda() as cuda:
        model = packed.to(device=cuda, dtype=torch.bfloat16)
        engine = OdbEngine(LocalBackend(model, device=cuda), world_size=1, max_tokens=4096, pad_token_id=0)
        loss, _ = engine.forward_loss(samples, False)
        loss = float(loss)
    print(f"liger {release}: calls {[(c['hidden'], c['settings']['softcap']) for c in liger_calls]}, "
          f"loss {loss:.4f} vs alone {alone:.4f}")
    scored = sum(len(s["input_ids"]) - 1 for s in samples)
    assert liger_calls and sum(c["hidden"][0] for c in liger_calls) == scored and all(c["on_cuda"] for c in liger_calls)
    assert {(c["settings"]["reduction"], c["settings"]["ignore_index"], c["settings"]["softcap"])
            for c in liger_calls} == {("sum", -100, 30.0)}
    assert abs(loss - alone) <= BF16_RTOL * alone
