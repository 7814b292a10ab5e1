"""odb_varlen against the model's own eager attention on each sample alone (STYLE 16).

Tiny random-init models of the families odb trains (Llama; Qwen2 and Mistral with sliding
windows; Gemma-2 with soft-capping and alternating window layers; Qwen2-VL, Qwen2.5-VL and
Qwen3-VL with their vision towers), built twice from one state dict: ``"odb_varlen"`` on a packed
row against ``"eager"`` on each sample alone, in train mode, forward and gradients. Then: dropout
keeps samples apart, padded rows match eager, gpt-oss's attention sinks match its own eager
attention, and a spy checks that every argument any layer (the mixture-of-experts families of
:data:`MOE_FAMILIES` included: tests/unit/test_moe.py) passes to the attention function is one odb_varlen implements.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
)
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention

from conftest import ROOT, bundled_tokenizer, one_step_plan
from odb.data.collate import VISION_KEYS, collate_packed, collate_padded
from odb.training import attention
from odb.training.attention import kernels
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model, hf_model
from odb.training.model.mrope import packed_position_ids
from odb.training.step.engine import OdbEngine
from odb.training.step.loss import DEFAULT_LOSS_CHUNK_TOKENS

WINDOW = 16
TEXT = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.1,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
TEXT_FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "mistral": {"model_type": "mistral", "sliding_window": WINDOW},
    "gemma2": {"model_type": "gemma2", "sliding_window": WINDOW, "attn_logit_softcapping": 1.0,
               "final_logit_softcapping": None, "query_pre_attn_scalar": 16},
}
# Mixture-of-experts families (tests/unit/test_moe.py): 4 experts, top-2, a router loss coefficient
# large enough that leaving the router loss out moves the gradients far past the tolerances.
MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.1}
MOE_FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32, **MOE},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "sliding_window": WINDOW, **MOE},
    "olmoe": {"model_type": "olmoe", "num_experts": 4, **MOE},
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 4, "sliding_window": WINDOW, **MOE},
}
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
VISION = {"depth": 2, "hidden_size": 64, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
          "temporal_patch_size": 2, "in_channels": 3, "initializer_range": 0.1}
IMAGE_IDS = {"image_token_id": 7, "video_token_id": 8, "vision_start_token_id": 5, "vision_end_token_id": 6}
VL_FAMILIES = {
    "qwen2_vl": {"model_type": "qwen2_vl",
                 "text_config": {"model_type": "qwen2_vl_text", "rope_parameters": ROPE, **TEXT},
                 "vision_config": {"model_type": "qwen2_vl", "embed_dim": 64, "mlp_ratio": 2, **VISION}},
    "qwen2_5_vl": {"model_type": "qwen2_5_vl",
                   "text_config": {"model_type": "qwen2_5_vl_text", "rope_parameters": ROPE, **TEXT},
                   "vision_config": {"model_type": "qwen2_5_vl", "intermediate_size": 128, "out_hidden_size": 64,
                                     "window_size": 56, "fullatt_block_indexes": [1], **VISION}},
    "qwen3_vl": {"model_type": "qwen3_vl",
                 "text_config": {"model_type": "qwen3_vl_text", "rope_parameters": {**ROPE, "mrope_interleaved": True},
                                 **TEXT},
                 "vision_config": {"model_type": "qwen3_vl", "intermediate_size": 128, "out_hidden_size": 64,
                                   "num_position_embeddings": 64, "deepstack_visual_indexes": [0], **VISION}},
}
TEXT_LENGTHS = (40, 7, 96, 1, 23, 64)
PATCH_WIDTH = 3 * 2 * 14 * 14


def config(family: str, **overrides):
    if family in VL_FAMILIES:
        spec = VL_FAMILIES[family]
        text = {**spec["text_config"], **overrides}
        return AutoConfig.for_model(**{**spec, "text_config": text}, **IMAGE_IDS)
    return AutoConfig.for_model(**{**TEXT, **(TEXT_FAMILIES.get(family) or MOE_FAMILIES[family]), **overrides})


def build(family: str, implementation: str, state: dict | None = None, **overrides):
    """A train-mode model of ``family``; with ``state``, those weights."""
    auto = AutoModelForImageTextToText if family in VL_FAMILIES else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config(family, **overrides), attn_implementation=implementation)
    if family == "gpt_oss" and state is None:  # sinks of order 1 (init: ~0.1), different per head and layer
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def pair(family: str, **overrides):
    """The same weights twice: odb_varlen (packed rows) and eager (the oracle)."""
    packed = build(family, attention.register(), **overrides)
    return packed, build(family, "eager", packed.state_dict(), **overrides)


def text_samples(lengths=TEXT_LENGTHS, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(10, 1000, (n,), generator=gen).tolist()} for n in lengths]


def image_sample(grid: tuple[int, int, int], num_text: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2] // 4
    ids = [5] + [7] * tokens + [6] + torch.randint(10, 1000, (num_text,), generator=gen).tolist()
    return {"input_ids": ids, "pixel_values": torch.randn(grid[0] * grid[1] * grid[2], PATCH_WIDTH, generator=gen),
            "image_grid_thw": torch.tensor([grid])}


def video_sample(family: str, grid: tuple[int, int, int], num_text: int, seed: int, seconds: float = 1.0) -> dict:
    """A sample with one video of ``grid`` (t, h, w) patches, as its family's processor lays it out:
    Qwen2-VL and Qwen2.5-VL one run of video tokens; Qwen3-VL a run per temporal patch, each after
    its timestamp's text tokens, inside the outer vision start and end. Qwen2.5-VL's samples carry
    the video's seconds per temporal patch."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    if family == "qwen3_vl":
        groups = [torch.randint(10, 1000, (3,), generator=gen).tolist() + [5] + [8] * (h * w // 4) + [6]
                  for _ in range(t)]
        ids = [5] + [i for group in groups for i in group] + [6]
    else:
        ids = [5] + [8] * (t * h * w // 4) + [6]
    sample = {"input_ids": ids + torch.randint(10, 1000, (num_text,), generator=gen).tolist(),
              "pixel_values_videos": torch.randn(t * h * w, PATCH_WIDTH, generator=gen),
              "video_grid_thw": torch.tensor([grid])}
    if family == "qwen2_5_vl":
        sample["second_per_grid_ts"] = torch.tensor([seconds])
    return sample


def video_samples(family: str) -> list[dict]:
    """Videos of different lengths and seconds beside an image, an image-and-video sample, a sample
    with two videos, one without seconds (Qwen2.5-VL's default 1.0), a video-then-image sample and text."""
    both = image_sample((1, 4, 4), 5, 7)
    mixed = video_sample(family, (2, 4, 6), 12, 8, seconds=0.5)
    both = {**mixed, "input_ids": both["input_ids"] + mixed["input_ids"], "pixel_values": both["pixel_values"],
            "image_grid_thw": both["image_grid_thw"]}
    two = [video_sample(family, (2, 4, 4), 3, 11, seconds=0.25), video_sample(family, (1, 4, 4), 4, 12, seconds=1.5)]
    two = {"input_ids": two[0]["input_ids"] + two[1]["input_ids"],
           **{k: torch.cat([two[0][k], two[1][k]]) for k in two[0] if k != "input_ids"}}
    unset = {k: v for k, v in video_sample(family, (1, 6, 4), 8, 10).items() if k != "second_per_grid_ts"}
    first = video_sample(family, (1, 4, 4), 3, 13, seconds=0.75)  # a video, then an image, in one sample
    after = image_sample((1, 4, 4), 4, 14)
    first = {**first, "input_ids": first["input_ids"] + after["input_ids"], "pixel_values": after["pixel_values"],
             "image_grid_thw": after["image_grid_thw"]}
    return [video_sample(family, (3, 4, 4), 20, 5, seconds=2.0), image_sample((1, 4, 6), 9, 6),
            *text_samples((15,), 9), both, two, unset, first]


def vl_samples() -> list[dict]:
    return [image_sample((1, 8, 8), 30, 0), *text_samples((20,), 1), image_sample((1, 4, 4), 10, 2),
            image_sample((1, 4, 6), 45, 3)]


def packed_forward(model, samples: list[dict]):
    """Logits of packed samples from a plain call with the packed row's varlen arguments, for the
    tests of one mechanism (dropout, the arguments layers pass); the tests against each sample
    alone go through odb's engine (:func:`engine_logits`, :func:`compare_packed_with_alone`)."""
    batch = collate_packed(samples)
    cu = batch["cu_seq_lens_q"]
    extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
    if extra:
        position_ids = packed_position_ids(model, batch["input_ids"], cu, extra["image_grid_thw"])
    else:
        position_ids = batch["position_ids"]
    logits = model(input_ids=batch["input_ids"], position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"],
                   **extra).logits
    return logits, batch["labels"], cu.tolist()


def engine(model, *, max_tokens: int = 4096, loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS) -> OdbEngine:
    """odb's engine over ``model`` in this process (no router loss: a MoE router's has tests of its own)."""
    odb = OdbEngine(LocalBackend(model), world_size=1, max_tokens=max_tokens, pad_token_id=0,
                    loss_chunk_tokens=loss_chunk_tokens)
    odb.router_loss = None
    return odb


def engine_logits(model, samples: list[dict]) -> list[torch.Tensor]:
    """Each sample's logits as odb's engine computes them in one packed micro-batch (its collate,
    M-RoPE positions, a blank image where a vision model's micro-batch has none)."""
    odb = engine(model, loss_chunk_tokens=None)
    samples = labelled(samples)
    odb.eval_step(one_step_plan([samples]), [samples])
    bounds = odb.backend.last_batch["cu_seq_lens_q"].tolist()
    logits = odb.backend.last.logits
    return [logits[0, a:b] for a, b in zip(bounds, bounds[1:])][:len(samples)]


def labelled(samples: list[dict]) -> list[dict]:
    """Processed samples as the data workers hand them over: with their labels (here every token)."""
    return [{**s, "labels": s.get("labels", s["input_ids"])} for s in samples]


def own_loss_sum(model, sample: dict) -> torch.Tensor:
    """The model's own loss on ``sample`` alone (``labels=``: its mean over the shifted labels)
    times the number of those labels: the summed next-token loss."""
    batch = collate_packed([sample])
    count = int((batch["labels"][0, 1:] != -100).sum())
    if not count:
        return torch.zeros(())
    return alone_forward(model, sample, labels=batch["labels"])[0].loss * count


def alone_forward(model, sample: dict, **kwargs):
    """One sample on its own, the plain transformers way: the output (``kwargs`` passed on) or, by
    default, logits ``[1, L, V]``; and labels."""
    batch = collate_packed([sample])
    extra = {k: batch[k] for k in VISION_KEYS if k in batch}
    if getattr(hf_model(model).config, "vision_config", None) is not None:  # M-RoPE from the image and video tokens
        ids = batch["input_ids"]
        extra["mm_token_type_ids"] = ((ids == IMAGE_IDS["image_token_id"]).int()
                                      + 2 * (ids == IMAGE_IDS["video_token_id"]).int())
    out = model(input_ids=batch["input_ids"], use_cache=False, **extra, **kwargs)
    return (out if kwargs else out.logits), batch["labels"]


def max_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().abs().max())


def check_close(actual, expected, atol: float, what: str) -> None:
    diff = max_diff(actual, expected)
    print(f"{what}: max abs diff {diff:.2e}")
    assert diff <= atol, f"{what}: max abs diff {diff:.2e} > {atol:.0e}"


def check_grads(packed, oracle, rtol: float, what: str) -> None:
    """Every parameter gradient of ``packed`` equals the oracle's, relative to its largest entry."""
    oracle_grads = dict(oracle.named_parameters())
    worst, worst_name = 0.0, ""
    for name, param in packed.named_parameters():
        expected, actual = oracle_grads[name].grad, param.grad
        if expected is None and actual is not None and not actual.any():
            continue  # what only odb's blank image reaches (a vision tower beside text only): exactly 0
        assert (actual is None) == (expected is None), name
        if expected is None:
            continue
        rel = max_diff(param.grad, expected) / max(float(expected.abs().max()), 1e-12)
        worst, worst_name = max((worst, worst_name), (rel, name))
    print(f"{what}: worst relative gradient diff {worst:.2e} ({worst_name})")
    assert worst <= rtol, f"{what}: gradient of {worst_name} off by {worst:.2e} (relative)"


def compare_packed_with_alone(family: str, samples: list[dict]) -> None:
    """odb's engine on one packed micro-batch (its collate, positions, blank image and loss, in
    chunks) against the model's own eager attention and own loss on each sample alone: logits,
    the summed loss and every gradient."""
    packed, oracle, samples = *pair(family), labelled(samples)
    logits = engine_logits(packed, samples)
    plan = one_step_plan([samples])
    result = engine(packed).train_step(plan, [samples], lr=0.0)  # backs sum(token losses) / N_step
    total, diffs = torch.zeros(()), []
    for sample, mine in zip(samples, logits, strict=True):
        alone, _ = alone_forward(oracle, sample)
        diffs.append(max_diff(mine, alone[0]))
        total = total + own_loss_sum(oracle, sample)
    lengths = [len(s["input_ids"]) for s in samples]
    check_close(torch.tensor(diffs), torch.zeros(len(diffs)), 1e-5,
                f"{family} logits, samples of {lengths} tokens ({', '.join(f'{d:.1e}' for d in diffs)})")
    loss_rel = abs(result.loss_sum - float(total)) / max(float(total), 1e-12)
    print(f"{family}: summed loss {float(total):.6f}, rel diff {loss_rel:.1e}")
    assert loss_rel <= 1e-5, f"{family}: odb's summed loss off by {loss_rel:.1e} relative"
    (total / plan.num_label_tokens).backward()
    check_grads(packed, oracle, 1e-5, family)


@pytest.mark.parametrize("family", sorted(TEXT_FAMILIES))
def test_packed_text_row_matches_eager_on_each_sample_alone(family):
    """Windows (16, samples up to 96 tokens) and soft-capping are honoured per sample, in train
    mode at dropout 0: logits and the gradient of the summed loss."""
    compare_packed_with_alone(family, text_samples())


def test_packed_row_under_bf16_autocast_matches_sdpa_on_each_sample_alone():
    """Mixed precision as HF Trainer and TRL run it (bf16 autocast over fp32 weights, here on the
    CPU): the packed row's attention computes in bf16 as the model's own SDPA does, and its logits
    match each sample alone through SDPA under the same autocast."""
    packed = build("llama", attention.register())
    oracle = build("llama", "sdpa", packed.state_dict())
    samples = text_samples((40, 7, 25))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _, cu = packed_forward(packed, samples)
        for sample, (start, end) in zip(samples, pairwise(cu), strict=True):
            alone, _ = alone_forward(oracle, sample)
            check_close(logits[0, start:end].float(), alone[0].float(), 5e-2, "bf16 autocast, packed vs alone")


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_packed_vl_row_matches_eager_on_each_sample_alone(family):
    """Images, a text-only sample and M-RoPE in one row; the vision tower's gradients included."""
    compare_packed_with_alone(family, vl_samples())


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_packed_row_with_videos_matches_eager_on_each_sample_alone(family):
    """Videos of 1-3 temporal patches (Qwen2.5-VL: each with its own seconds per patch; Qwen3-VL:
    a run per patch after its timestamp's tokens), an image, a sample with both, and text in one
    row: each sample's own M-RoPE, temporal axis included; logits, loss and every gradient."""
    compare_packed_with_alone(family, video_samples(family))


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_the_vision_tower_runs_once_per_micro_batch_whatever_it_holds(family):
    """ZeRO-3 and FSDP2 gather the tower's parameters per call: every rank must call it as often
    as its peers in every micro-batch. Images and videos, videos alone, images alone and text
    alone (the blank image) each make one call."""
    model = build(family, attention.register())
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    videos = video_samples(family)
    for samples in (videos, videos[:1], [image_sample((1, 4, 4), 5, 7)], text_samples((12,), 3)):
        calls.clear()
        odb = engine(model, loss_chunk_tokens=None)
        odb.eval_step(one_step_plan([labelled(samples)]), [labelled(samples)])
        assert len(calls) == 1, (len(samples), len(calls))
        blank = not any("pixel_values" in s or "pixel_values_videos" in s for s in samples)
        rows = len(odb.backend.last_batch["cu_seq_lens_q"]) - 1
        assert rows == len(samples) + blank, (len(samples), rows)  # the blank image only where nothing else


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_a_vision_models_micro_batch_without_images_matches_eager(family):
    """odb adds a blank image to a vision model's micro-batch that has none (the vision tower runs
    on every rank alike): the text samples' logits, loss and gradients stay each sample's alone;
    the vision tower's gradient is exactly 0."""
    compare_packed_with_alone(family, text_samples((30, 12), seed=4))


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_vision_tower_is_bidirectional_and_matches_eager(family):
    packed, oracle = pair(family)
    image, other = image_sample((1, 8, 8), 0, 0), image_sample((1, 4, 6), 0, 1)
    pixels = torch.cat([image["pixel_values"], other["pixel_values"]])
    grid = torch.cat([image["image_grid_thw"], other["image_grid_thw"]])
    out = packed.model.visual(pixels, grid_thw=grid).pooler_output
    check_close(out, oracle.model.visual(pixels, grid_thw=grid).pooler_output, 1e-5, f"{family} vision tower")
    perturbed = pixels.clone()
    perturbed[63] += 1.0  # the first image's last patch
    moved = max_diff(packed.model.visual(perturbed, grid_thw=grid).pooler_output[0], out[0])
    print(f"{family}: first visual token moved {moved:.2e} when the last patch changed")
    assert moved > 1e-4, "the first visual token does not see the image's last patch: the tower ran causal"


def test_dropout_stays_inside_each_sample():
    """Train mode, attention dropout 0.1: changing only sample A leaves sample B exactly as it was
    under the same seed; another seed moves B (the dropout is applied, not dropped)."""
    model = build("llama", attention.register(), attention_dropout=0.1)
    a, b = text_samples((40, 30), seed=0)
    a_changed = text_samples((40,), seed=5)[0]

    def b_logits(first: dict, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        logits, _, bounds = packed_forward(model, [first, b])
        return logits[0, bounds[1]:bounds[2]].detach()

    moved = max_diff(b_logits(a_changed, 0), b_logits(a, 0))
    print(f"sample B moved {moved:.2e} when only sample A changed")
    assert moved == 0.0, f"sample B moved {moved:.2e} when only sample A changed: dropout path leaks"
    assert max_diff(b_logits(a, 1), b_logits(a, 0)) > 1e-3, "attention dropout was not applied"


@pytest.mark.parametrize("family", [*sorted(TEXT_FAMILIES), "gpt_oss"])
def test_padded_rows_match_eager(family):
    """The padded baselines (an attention_mask) and full rows of one length (no mask at all);
    gpt-oss's sinks in the explicit math."""
    packed, oracle = pair(family)
    for lengths in ((40, 7, 23), (12, 12)):
        batch = collate_padded(text_samples(lengths), pad_token_id=0)
        kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        real = batch["attention_mask"].bool()
        actual, expected = (m(**kwargs, use_cache=False).logits[real].detach() for m in (packed, oracle))
        check_close(actual, expected, 1e-5, f"{family} padded {lengths}")


class _Layer(torch.nn.Module):
    """What eager's attention function reads from its module."""

    num_key_value_groups = 2
    is_causal = True


FUNCTION_CASES = {  # name: (varlen kwargs, transformers' mask function)
    "causal": ({}, causal_mask_function),
    "window": ({"sliding_window": 5}, sliding_window_causal_mask_function(5)),
    "softcap": ({"softcap": 1.0}, causal_mask_function),
    "window+softcap": ({"sliding_window": 5, "softcap": 1.0}, sliding_window_causal_mask_function(5)),
    "bidirectional": ({"is_causal": False}, and_masks(bidirectional_mask_function)),
}


@pytest.mark.parametrize("case", sorted(FUNCTION_CASES))
def test_attention_function_matches_transformers_eager_per_sample(case):
    """The function alone, scores of order 1 (so a cap of 1.0 bites), GQA 4:2, with and without
    ``cu_seq_lens_q``; oracle: transformers' eager attention with its own mask, sample by sample."""
    kwargs, mask_function = FUNCTION_CASES[case]
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 9, 10, 31, 38, 46, 57, 60]  # lengths 9, 1, 21, 7, 8, 11, 3: several groups of one row
    q = torch.randn(1, 4, bounds[-1], 16, generator=gen)
    k, v = (torch.randn(1, 2, bounds[-1], 16, generator=gen) for _ in range(2))
    upstream = torch.randn(1, bounds[-1], 4, 16, generator=gen)  # d loss / d out, for the gradients
    cu = torch.tensor(bounds, dtype=torch.int32)
    positions = torch.cat([torch.arange(b - a) for a, b in pairwise(bounds)])[None]
    module = _Layer()
    expected, expected_grads = [], []
    for start, end in pairwise(bounds):
        index = torch.arange(end - start)
        allowed = mask_function(0, 0, index[:, None], index[None, :])
        mask = torch.zeros(end - start, end - start).masked_fill(~allowed, torch.finfo(q.dtype).min)
        pieces = [t[:, :, start:end].clone().requires_grad_() for t in (q, k, v)]
        alone, _ = eager_attention_forward(module, *pieces, mask[None, None], scaling=0.25,
                                           softcap=kwargs.get("softcap"))
        (alone * upstream[:, start:end]).sum().backward()
        expected.append(alone.detach())
        expected_grads.append([t.grad for t in pieces])
    for how in ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, {"position_ids": positions}):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = attention.varlen_attention(module, *inputs, None, scaling=0.25, **kwargs, **how)
        check_close(out, torch.cat(expected, dim=1), 1e-5, f"{case}, samples by {next(iter(how))}")
        (out * upstream).sum().backward()
        for name, actual, grads in zip("qkv", inputs, zip(*expected_grads)):
            check_close(actual.grad, torch.cat(grads, dim=2), 1e-5, f"{case}: d{name}, samples by {next(iter(how))}")


SINK_CASES = {  # name: (varlen kwargs, transformers' mask function)
    "causal": ({}, causal_mask_function),
    "window": ({"sliding_window": 5}, sliding_window_causal_mask_function(5)),
    "bidirectional": ({"is_causal": False}, and_masks(bidirectional_mask_function)),
}


class _SinkLayer(_Layer):
    """What gpt-oss's eager attention reads from its module: its sinks too."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks = sinks


@pytest.mark.parametrize("case", sorted(SINK_CASES))
def test_sinks_match_gpt_oss_eager_per_sample(case):
    """gpt-oss's attention sinks (``s_aux``, one logit per head, of order 1): the output and the
    gradients of q, k, v and the sinks, samples given by ``cu_seq_lens_q`` or by positions; the
    oracle is gpt-oss's own eager attention on each sample alone. A one-token sample (bounds 9-10)
    is where the sink weighs most: its only key shares the softmax with the sink."""
    kwargs, mask_function = SINK_CASES[case]
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 9, 10, 31, 38]
    q = torch.randn(1, 4, bounds[-1], 16, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, bounds[-1], 16, generator=gen).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=gen).requires_grad_()
    weights = torch.randn(1, bounds[-1], 4, 16, generator=gen)  # a random linear loss of the output
    module = _SinkLayer(sinks).train()
    cu = torch.tensor(bounds, dtype=torch.int32)
    positions = torch.cat([torch.arange(b - a) for a, b in pairwise(bounds)])[None]
    expected = []
    for start, end in pairwise(bounds):
        index = torch.arange(end - start)
        allowed = mask_function(0, 0, index[:, None], index[None, :])
        mask = torch.zeros(end - start, end - start).masked_fill(~allowed, torch.finfo(q.dtype).min)
        alone, _ = gpt_oss_eager_attention(module, q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                           mask[None, None], scaling=0.25)
        expected.append(alone)
    expected = torch.cat(expected, dim=1)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [q, k, v, sinks])
    for how in ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, {"position_ids": positions}):
        out, _ = attention.varlen_attention(module, q, k, v, None, scaling=0.25, s_aux=sinks, **kwargs, **how)
        check_close(out, expected, 1e-5, f"sinks, {case}, samples by {next(iter(how))}")
        grads = torch.autograd.grad((out * weights).sum(), [q, k, v, sinks])
        for name, got, want in zip("q k v sinks".split(), grads, expected_grads, strict=True):
            check_close(got / want.abs().max(), want / want.abs().max(), 1e-5, f"sinks, {case}: gradient of {name}")
    ignored, _ = attention.varlen_attention(module, q, k, v, None, scaling=0.25, **kwargs, cu_seq_lens_q=cu)
    assert max_diff(ignored, expected) > 1e-2, "the sinks do not change the output: the test cannot see them"


def test_flash_window_is_transformers_sliding_window():
    """The (left, right) odb_varlen hands Flash Attention keeps exactly the keys transformers'
    sliding window keeps (flash: key j visible iff i - left <= j <= i + right; -1 no limit)."""
    index = torch.arange(40)
    q_idx, kv_idx = index[:, None], index[None, :]
    for window in (1, 5, 16):
        left, right = kernels.flash_window(True, window)
        flash = ((left < 0) | (kv_idx >= q_idx - left)) & ((right < 0) | (kv_idx <= q_idx + right))
        assert torch.equal(flash, sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx)), window


@pytest.mark.parametrize("kwargs,needle", [
    ({"alibi_slopes": torch.zeros(4)}, "alibi_slopes"),
    ({"position_bias": torch.zeros(1, 4, 8, 8)}, "position_bias"),
    ({"output_attentions": True}, "output_attentions"),
    ({"is_causal": False, "sliding_window": 4}, "sliding_window"),
])
def test_an_argument_odb_varlen_does_not_implement_raises_naming_it(kwargs, needle):
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match=needle):
        attention.varlen_attention(_Layer(), q, q[:, :2], q[:, :2], None, **kwargs)


def test_decoding_with_a_cache_is_refused():
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="use_cache=False"):
        attention.varlen_attention(_Layer(), q, k, k, None)


def test_every_argument_any_layer_passes_is_implemented(monkeypatch):
    """Every family in train mode (attention dropout 0.1), text layers and vision towers: every
    argument that reaches odb_varlen with a value is in ``HANDLED_KWARGS``, so the next model
    family cannot slip an argument past it."""
    received: dict[str, set[str]] = {}  # argument -> the modules that passed it
    scalars: set[tuple[str, object]] = set()  # (argument, value) for the non-tensor ones
    refused: list[str] = []
    original = AttentionInterface._global_mapping[attention.register()]

    def spy(module, query, key, value, attention_mask=None, **kwargs):
        for name, value_ in {"attention_mask": attention_mask, **kwargs}.items():
            if value_ is not None:
                received.setdefault(name, set()).add(type(module).__name__)
                if isinstance(value_, bool | int | float | str):
                    scalars.add((name, value_))
        try:
            return original(module, query, key, value, attention_mask, **kwargs)
        except ValueError as error:  # collected, so one run names every gap
            refused.append(f"{type(module).__name__}: {error}")
            return query.transpose(1, 2).contiguous(), None

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.ATTN_IMPLEMENTATION, spy)
    for family in sorted(TEXT_FAMILIES):
        packed_forward(build(family, attention.ATTN_IMPLEMENTATION, attention_dropout=0.1), text_samples())
    for family in sorted(VL_FAMILIES):
        packed_forward(build(family, attention.ATTN_IMPLEMENTATION, attention_dropout=0.1), vl_samples())
    for family in sorted(MOE_FAMILIES):  # the MoE layers pass output_router_logits, gpt-oss s_aux
        packed_forward(build(family, attention.ATTN_IMPLEMENTATION, attention_dropout=0.1), text_samples())
    assert {("dropout", 0.1), ("sliding_window", WINDOW), ("softcap", 1.0), ("is_causal", False)} <= scalars
    assert {"s_aux", "output_router_logits"} <= set(received)
    unknown = {name: sorted(modules) for name, modules in received.items() if name not in attention.HANDLED_KWARGS}
    assert not unknown, f"odb_varlen received arguments it does not implement: {unknown}"
    assert not refused, f"odb_varlen refused calls of families odb trains: {sorted(set(refused))}"


def test_packed_samples_give_the_logits_they_give_alone():
    """The bundled tiny model, packed through odb_varlen (and through position ids alone, as
    transformers finds the boundaries itself) against each sample alone."""
    attention.register()
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=1, vocab_size=len(bundled_tokenizer())).eval()
    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(5, 1000, (n,), generator=gen).tolist()} for n in (7, 30, 1, 64, 33, 12)]
    batch = collate_packed(samples)
    cu = batch["cu_seq_lens_q"]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch["max_length_q"],
                       max_length_k=batch["max_length_k"]).logits
        from_positions = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               use_cache=False).logits
        bounds = cu.tolist()
        for sample, start, end in zip(samples, bounds, bounds[1:]):
            alone = model(input_ids=torch.tensor([sample["input_ids"]]), use_cache=False).logits[0]
            assert torch.allclose(packed[0, start:end], alone, atol=1e-5, rtol=1e-5)
            assert torch.allclose(from_positions[0, start:end], alone, atol=1e-5, rtol=1e-5)
        # the attention is what keeps samples apart: a plain causal row over the same tokens differs
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits
        assert not torch.allclose(leaky[0, bounds[1]:bounds[2]], packed[0, bounds[1]:bounds[2]], atol=1e-3)
