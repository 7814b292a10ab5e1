#!/usr/bin/env python
"""odb's varlen attention on packed rows against each sample run alone, on the GPU (part of
tools/check/gpu_check.sh; also runs on CPU, where it checks odb's grouped SDPA path).

First, before any model: :func:`odb.training.attention.cuda.attention_path` names the path this
device takes (flash-attn, or torch's ``varlen_attn`` called by its installed signature, or SDPA
per group) after one checked packed call; a path that cannot run is reported (``refused``, the
fix in its message) instead of failing later. Then, for tiny random-init models of five families
(Llama; Qwen2 with a sliding window; Gemma-2 with soft-capping and windows; gpt-oss with attention
sinks, alternating window layers and mixture-of-experts layers; DeepSeek-V3's MLA, value heads
narrower than q's), in the given dtype: one packed
row of samples through ``attn_implementation="odb_varlen"`` against each sample alone through the
model's own ``sdpa`` (``eager`` for Gemma-2 and gpt-oss, whose soft-capping and sinks SDPA lacks),
in train mode without dropout: the largest logit difference, the largest relative gradient
difference, a leak check (sample 0's tokens changed: how far the other samples' logits moved,
which must be 0 up to kernel noise), and which paths odb_varlen's calls took (``calls``: softcap
and sinks take the per-group path wherever no installed kernel has them).

    python tools/check/gpu_check_attention.py --device cuda --dtype bfloat16

On CUDA each installed kernel is checked in turn (``paths``): the first flash kernel
(FlashAttention-3 or flash-attn) where one is installed, and torch's ``varlen_attn`` with the flash
kernels hidden. The last line of stdout is one JSON object: the torch ``varlen_attn`` signature
found, and per path the words the probe names it by and per family the figures and whether they
are within the tolerances of the dtype.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from odb.data.collate import collate_packed  # noqa: E402
from odb.training import attention  # noqa: E402
from odb.training.attention import kernels as cuda_varlen  # noqa: E402

WINDOW = 64
BASE = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "initializer_range": 0.05,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "max_position_embeddings": 4096}
FAMILIES = {
    "llama": ({"model_type": "llama"}, "sdpa"),
    "qwen2": ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
              "sdpa"),
    "gemma2": ({"model_type": "gemma2", "sliding_window": WINDOW, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": None, "query_pre_attn_scalar": 64}, "eager"),
    "gpt_oss": ({"model_type": "gpt_oss", "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
                "eager"),
    # MLA: q/k heads of 96, value heads of 64 (odb pads them to 96 for the kernels and cuts the output back)
    "deepseek_v3": ({"model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_group": 1, "topk_group": 1,
                     "q_lora_rank": 64, "kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64,
                     "v_head_dim": 64, "head_dim": 32, "rope_interleave": False, "first_k_dense_replace": 1}, "eager"),
}
LENGTHS = (300, 17, 1024, 1, 511, 129)
# max |logit diff| and max relative gradient diff allowed, by dtype (bf16: 8 bits of mantissa)
TOLERANCE = {torch.bfloat16: (0.15, 0.05), torch.float16: (0.03, 0.02), torch.float32: (1e-3, 1e-3)}


def build(family: str, implementation: str, dtype, device, state=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**BASE, **spec}),
                                             attn_implementation=implementation, dtype=dtype)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device).train()


def packed_logits(model, samples, device):
    batch = collate_packed(samples)
    cu = batch["cu_seq_lens_q"].to(device)
    return model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                 cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch["max_length_q"],
                 max_length_k=batch["max_length_k"], use_cache=False).logits[0]


def check(family: str, dtype, device) -> dict:
    gen = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(2, BASE["vocab_size"], (n,), generator=gen)} for n in LENGTHS]
    packed = build(family, attention.register(), dtype, device)
    oracle = build(family, FAMILIES[family][1], dtype, device, state=packed.state_dict())
    before_calls = attention.calls.copy()
    logits = packed_logits(packed, samples, device)
    calls = dict(attention.calls - before_calls)
    logits.float().pow(2).mean().backward()
    alone = [oracle(input_ids=s["input_ids"][None].to(device), use_cache=False).logits[0] for s in samples]
    torch.cat(alone).float().pow(2).mean().backward()
    logit_diff = (logits.float() - torch.cat(alone).float()).abs().max().item()
    grad_diff = max(((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-12)).item()
                    for p, q in zip(packed.parameters(), oracle.parameters()) if q.grad is not None)
    with torch.no_grad():  # change sample 0 only: nothing else may move
        changed = [{"input_ids": torch.flip(samples[0]["input_ids"], [0])}, *samples[1:]]
        before = packed_logits(packed, samples, device)[LENGTHS[0]:]
        after = packed_logits(packed, changed, device)[LENGTHS[0]:]
        leak = (before.float() - after.float()).abs().max().item()
    max_logit, max_grad = TOLERANCE[dtype]
    return {"max_abs_logit_diff": logit_diff, "max_rel_grad_diff": grad_diff, "leak_max_abs": leak, "calls": calls,
            "ok": logit_diff <= max_logit and grad_diff <= max_grad and leak <= max_logit / 10}


def kernel_paths() -> dict[str, object]:
    """The CUDA kernels installed, each to check on its own: the first flash kernel (FlashAttention-3
    or flash-attn) where one is, and torch's varlen_attn (flash kernels hidden) where it exists."""
    paths, errors = {}, dict(cuda_varlen.flash_attn_errors())  # (read before the torch path's patch)
    if cuda_varlen.flash_kernels():
        paths["flash"] = cuda_varlen._flash_imports
    if cuda_varlen.torch_varlen_api() is not None:
        paths["torch"] = lambda: ((), errors)
    return paths or {"none": cuda_varlen._flash_imports}


def check_path(device, dtype) -> dict:
    """The path the probe names and every family through it (``ok``: all within the tolerances)."""
    try:
        result = {"path": attention.attention_path(device, dtype)}
    except RuntimeError as error:  # the path cannot run here: say why (its message names the fix), check nothing
        return {"path": None, "refused": str(error), "ok": False}
    print(f"odb_varlen on {device} in {str(dtype).removeprefix('torch.')}: {result['path']}", file=sys.stderr,
          flush=True)
    result["families"] = {family: check(family, dtype, device) for family in FAMILIES}
    result["ok"] = all(r["ok"] for r in result["families"].values())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 on CUDA, float32 on CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    api = cuda_varlen.torch_varlen_api()
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "varlen_attn_signature": str(inspect.signature(api.function)) if api else None,
              "flash_kernels": [api.describe() for api in cuda_varlen.flash_kernels()],
              "flash_unused": cuda_varlen.flash_unused(), "lengths": list(LENGTHS), "paths": {}}
    installed = cuda_varlen._flash_imports
    for name, imports in (kernel_paths() if device.type == "cuda" else {"cpu": installed}).items():
        cuda_varlen._flash_imports = imports  # (torch's path: the flash kernels hidden for its turn)
        try:
            result["paths"][name] = check_path(device, dtype)
        finally:
            cuda_varlen._flash_imports = installed
    result["ok"] = all(r["ok"] for r in result["paths"].values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
