"""The chunked loss (odb/training/step/loss.py) against the model's own loss (STYLE 16).

odb's engine computes the loss of a packed micro-batch in chunks of the final hidden states; the
oracle is the model itself, on a copy with its own eager attention, each sample alone, its own
``labels=`` loss times its label count: it shares neither odb's collate, positions and attention
nor its loss code. Tiny random models of every family odb trains (the ones
tests/unit/test_attention.py builds): the summed loss to 1e-6 relative and every trainable
gradient to 1e-5 (relative to its largest entry), for chunk counts
that do and do not divide the scored tokens, one chunk larger than the row, more chunks than
scored tokens (chunks of padding only, labels all -100), prompts masked with -100, padded rows, a
micro-batch without labels, eval_step with a dummy, Gemma-2 with final soft-capping 30, and LoRA
(on the LM head too). Then: the head's projection never sees more than a chunk, per-sample sums
with gradients leave the head's call (ZeRO-3's hook on it), a family that rescales its logits
after the head is refused, and Liger (not installed) is never chosen here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_attention import (
    TEXT,
    TEXT_FAMILIES,
    VL_FAMILIES,
    build,
    own_loss_sum,
    text_samples,
    video_samples,
    vl_samples,
)
from transformers import AutoConfig, AutoModelForCausalLM

from odb.batching.cost import SampleCost, count_label_tokens
from odb.batching.plan import MicroBatch, StepPlan
from odb.training import attention
from odb.training.backends import LocalBackend
from odb.training.model.build import hf_model
from odb.training.step.engine import OdbEngine
from odb.training.step.loss import (
    HeadLoss,
    chunked_token_loss_sum,
    liger_loss,
    num_loss_chunks,
    scored_tokens,
    token_loss_sum,
)
from odb.training.step.sources import SourceSplit

SOFTCAP = 30.0
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def model_of(family: str, **overrides):
    if family == "gemma2":
        overrides.setdefault("final_logit_softcapping", SOFTCAP)
    return build(family, attention.register(), **overrides)


def forward_loss(model, samples: list[dict], *, max_tokens: int, chunk_tokens: int | None,
                 padded: bool = False) -> torch.Tensor:
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=max_tokens, pad_token_id=0,
                       loss_chunk_tokens=chunk_tokens)
    return engine.forward_loss(samples, padded)[0]


def trainable_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def eager_copy(model):
    """``model``'s copy with the model's own eager attention (the oracle's)."""
    oracle = copy.deepcopy(model)
    hf_model(oracle).set_attn_implementation("eager")
    return oracle


def compare(model, samples: list[dict], *, max_tokens: int, chunk_tokens: int, what: str,
            padded: bool = False) -> tuple[float, float]:
    """odb's loss in chunks on ``model`` against the model's own loss on each sample alone, on an
    eager copy: loss and gradients; returns (loss rel, grad rel)."""
    assert all(len(s["input_ids"]) <= max_tokens for s in samples), "the oracle cuts nothing"
    oracle = eager_copy(model)
    expected = sum((own_loss_sum(oracle, s) for s in samples), torch.zeros(()))
    if expected.requires_grad:
        expected.backward()
    actual = forward_loss(model, samples, max_tokens=max_tokens, chunk_tokens=chunk_tokens, padded=padded)
    actual.backward()
    actual_value, expected_value = actual.item(), expected.item()
    loss_rel = abs(actual_value - expected_value) / max(abs(expected_value), 1e-12)
    theirs = trainable_grads(oracle)
    worst, worst_abs, worst_name = 0.0, 0.0, ""
    for name, grad in trainable_grads(model).items():
        if theirs[name] is None and (grad is None or not grad.any()):
            continue  # (what only odb's blank image reaches, or no labels at all: exactly 0)
        assert grad is not None and theirs[name] is not None, name
        diff = float((grad - theirs[name]).abs().max())
        rel = diff / max(float(theirs[name].abs().max()), 1e-12)
        if rel > worst:
            worst, worst_abs, worst_name = rel, diff, name
    print(f"{what}: loss {expected_value:.6f}, rel diff {loss_rel:.1e}; "
          f"worst grad rel diff {worst:.1e} (abs {worst_abs:.1e}, {worst_name})")
    assert loss_rel <= LOSS_RTOL, f"{what}: loss off by {loss_rel:.1e} relative"
    assert worst <= GRAD_RTOL, f"{what}: gradient of {worst_name} off by {worst:.1e} relative"
    return loss_rel, worst


def masked(samples: list[dict], prompt: int) -> list[dict]:
    """Each sample with its first ``prompt`` labels -100 (a prompt), the rest its own ids."""
    return [{**s, "labels": [-100] * min(prompt, len(s["input_ids"])) + s["input_ids"][prompt:]} for s in samples]


# Scored tokens of text_samples(): 231 tokens, 6 samples -> 225; max_tokens / chunk -> chunks.
TEXT_CASES = {
    "5 chunks of 45": (256, 52),  # ceil(256 / 52) = 5 divides 225
    "7 chunks, uneven": (256, 37),  # ceil(256 / 37) = 7 does not
    "1 chunk, larger than the row": (256, 4096),
}


@pytest.mark.parametrize("family", sorted(TEXT_FAMILIES))
def test_chunked_equals_full_logits_on_packed_text_rows(family):
    model = model_of(family)
    for case, (max_tokens, chunk) in TEXT_CASES.items():
        compare(model, text_samples(), max_tokens=max_tokens, chunk_tokens=chunk, what=f"{family}, {case}")
        model.zero_grad()
    # prompts masked: 13 scored tokens in 40 chunks -> 27 chunks of padding only (labels all -100)
    compare(model, masked(text_samples(), 94), max_tokens=400, chunk_tokens=10,
            what=f"{family}, prompts masked, more chunks than scored tokens")


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_chunked_equals_full_logits_on_packed_image_text_rows(family):
    """Images (M-RoPE positions and pixels through the engine's own call), vision gradients too."""
    model = model_of(family)
    compare(model, vl_samples(), max_tokens=256, chunk_tokens=40, what=f"{family}, 7 chunks")
    model.zero_grad()
    compare(model, vl_samples()[1:2], max_tokens=256, chunk_tokens=4096,
            what=f"{family}, text only (a blank image added), 1 chunk")


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_videos_in_packed_chunks_and_in_padded_rows(family):
    """Videos beside images and text: packed with the loss in chunks, and as padded rows (the
    model's own M-RoPE over the batch from the token types, video tokens typed 2)."""
    model = model_of(family)
    compare(model, video_samples(family), max_tokens=256, chunk_tokens=40, what=f"{family} videos, chunks")
    model.zero_grad()
    compare(model, video_samples(family), max_tokens=256, chunk_tokens=4096, what=f"{family} videos, padded",
            padded=True)


def test_padded_rows_and_a_row_without_labels():
    """The padded layout (rows of one micro-batch shifted inside each row), and a micro-batch whose
    labels are all -100: loss 0 on both paths, gradients 0."""
    model = model_of("llama")
    compare(model, text_samples((40, 7, 23)), max_tokens=256, chunk_tokens=16, what="llama padded", padded=True)
    model.zero_grad()
    loss_rel, _ = compare(model, masked(text_samples((30, 9)), 100), max_tokens=64, chunk_tokens=16,
                          what="llama, no labels")
    assert loss_rel == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_eval_step_with_a_dummy_matches(family):
    """eval_step (no gradients, no recomputation): a real micro-batch and a dummy (a one-token row,
    or a blank image alone), whose chunks hold padding only."""
    model = model_of(family).eval()
    samples = vl_samples()[:2] if family in VL_FAMILIES else text_samples((40, 7, 96))
    samples = [{**s, "labels": s["input_ids"]} for s in samples]
    costs = tuple(SampleCost(uid=i, tokens=len(s["input_ids"]), label_tokens=count_label_tokens(s["input_ids"]),
                             patches=0, cost=0) for i, s in enumerate(samples))
    plan = StepPlan(epoch=0, step=0, micro_batches=(MicroBatch(costs), MicroBatch(())), num_label_tokens=0,
                    num_samples=len(samples), rank_costs=(), rank_tokens=())
    results = {chunk: OdbEngine(LocalBackend(model), world_size=1, max_tokens=256, pad_token_id=0,
                                loss_chunk_tokens=chunk).eval_step(plan, [samples, []]) for chunk in (None, 30)}
    (full, tokens), (chunked, chunked_tokens) = results[None], results[30]
    print(f"{family} eval: full {full:.6f}, chunked {chunked:.6f} ({tokens} label tokens)")
    assert tokens == chunked_tokens and abs(chunked - full) <= LOSS_RTOL * full


def test_gemma2_final_softcapping_is_applied_and_matches():
    """Soft-capping at 30 moves the loss far more than the tolerance, so a chunked path that left
    it out would fail; the chunked path with it matches."""
    model = model_of("gemma2")
    compare(model, text_samples(), max_tokens=256, chunk_tokens=37, what="gemma2, cap 30")
    hidden, labels = torch.randn(1, 50, 64), torch.randint(0, 1000, (1, 50))
    head = model.get_output_embeddings()
    with torch.no_grad():
        capped = chunked_token_loss_sum(hidden * 40, labels, head, num_chunks=3, softcap=SOFTCAP)
        uncapped = chunked_token_loss_sum(hidden * 40, labels, head, num_chunks=3)
    moved = abs(float(capped - uncapped)) / float(capped)
    print(f"soft-capping moves the loss by {moved:.1e} relative")
    assert moved > 100 * LOSS_RTOL


def test_lora_on_attention_and_lm_head():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model_of("qwen2"), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                          target_modules=["q_proj", "v_proj", "lm_head"]))
    for module in model.modules():  # B = 0 at init would hide LoRA's share of the gradient
        if hasattr(module, "lora_B"):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.1)
    assert any("lm_head" in name and "lora" in name for name, _ in model.named_parameters())
    compare(model, text_samples(), max_tokens=256, chunk_tokens=37, what="qwen2 + LoRA")


def test_the_head_never_sees_more_than_a_chunk(monkeypatch):
    """The head module is called twice per micro-batch (the model's own call, on one position per
    row, and the call that runs the chunks: one ZeRO-3 gather each), and its projection never makes
    more than ceil(N / chunks) rows of logits; the full path makes the whole row's."""
    model = model_of("llama")
    head = model.get_output_embeddings()
    rows: list[int] = []
    calls: list[str] = []
    linear = torch.nn.functional.linear

    def spy(input, weight, bias=None):
        out = linear(input, weight, bias)
        if weight is head.weight:
            rows.append(out[..., 0].numel())
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    handle = head.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    try:
        forward_loss(model, text_samples(), max_tokens=256, chunk_tokens=37).backward()
        chunked, chunked_calls = list(rows), list(calls)
        rows.clear()
        calls.clear()
        forward_loss(model, text_samples(), max_tokens=256, chunk_tokens=None).backward()
    finally:
        handle.remove()
    print(f"head projections, chunked: {chunked} (forward, then backward), full: {rows}")
    assert len(chunked_calls) == 2, f"the head module ran {len(chunked_calls)} times"
    assert chunked[0] == 1 and len(chunked) == 1 + 2 * 7 and max(chunked[1:]) == 33  # ceil(225 / 7)
    assert rows == [231] and len(calls) == 1


def test_direct_function_matches_on_random_head():
    """No model: hidden [2, 37, 16], a head with a bias, 30 scored tokens in 1, 4 (soft-capped at 2),
    29 and 80 chunks (50 of them padding only)."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(2, 37, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=gen)
    labels[0, 5:12] = -100
    labels[1, :] = -100
    labels[1, 20] = 3
    expected = token_loss_sum(head(hidden), labels)
    grads_expected = torch.autograd.grad(expected, [hidden, head.weight, head.bias])
    for num_chunks in (1, 4, 29, 80):
        actual = chunked_token_loss_sum(hidden, labels, head, num_chunks=num_chunks, softcap=2.0 if num_chunks == 4
                                        else None)
        if num_chunks == 4:
            expected_here = token_loss_sum(torch.tanh(head(hidden) / 2.0) * 2.0, labels)
            grads = torch.autograd.grad(expected_here, [hidden, head.weight, head.bias])
        else:
            expected_here, grads = expected, grads_expected
        for got, want in zip(torch.autograd.grad(actual, [hidden, head.weight, head.bias]), grads, strict=True):
            assert float((got - want).abs().max()) <= GRAD_RTOL * float(want.abs().max())
        assert abs((actual - expected_here).item()) <= LOSS_RTOL * expected_here.item()
    assert scored_tokens(hidden, labels)[1].numel() == 29 + 1  # row 0: 36 - 7 (-100 at 5..11); row 1: 1


def test_a_head_with_dropout_draws_the_same_mask_when_recomputed():
    """LoRA on the head has dropout: the backward's recomputation of a chunk must see the mask its
    forward drew. Reference: the same chunks (89 scored tokens in 3: rows 0-29-59-89), the same
    seed, no recomputation."""
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(16, 50))
    hidden = torch.randn(1, 90, 16, requires_grad=True)
    labels = torch.randint(0, 50, (1, 90))
    torch.manual_seed(1)
    actual = torch.autograd.grad(chunked_token_loss_sum(hidden, labels, head, num_chunks=3), hidden)[0]
    torch.manual_seed(1)
    hidden_nh, labels_n = scored_tokens(hidden, labels)
    expected = sum(torch.nn.functional.cross_entropy(head(hidden_nh[a:b]), labels_n[a:b], reduction="sum")
                   for a, b in ((0, 29), (29, 59), (59, 89)))
    expected = torch.autograd.grad(expected, hidden)[0]
    diff = float((actual - expected).abs().max())
    print(f"dropout in the head: gradient diff {diff:.1e}")
    assert diff <= GRAD_RTOL * float(expected.abs().max())


def test_per_sample_sums_with_gradients_leave_the_heads_call():
    """A preference step backs each sequence's own loss (a SourceSplit with ``graph``), not the
    call's total: those sums must be the head call's output, which carries ZeRO-3's pre-backward
    hook, the one that gathers the head's weight before the chunks are recomputed. Here a head's
    weight is there, as under ZeRO-3, only during its call and once a hook on its output has run
    in the backward; the gradients must be a plain head's (regression: the sums were built beside
    the call's output, and the recomputation met the released weight)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    whole = head.weight.data

    class Gather(torch.autograd.Function):  # ZeRO-3's PreBackwardFunctionForModule, gathering
        @staticmethod
        def forward(ctx, output):
            return output.view_as(output)

        @staticmethod
        def backward(ctx, grad):
            head.weight.data = whole
            return grad

    def release(module, args, output):
        head.weight.data = torch.empty(0)
        return Gather.apply(output)

    handles = [head.register_forward_pre_hook(lambda module, args: setattr(head.weight, "data", whole)),
               head.register_forward_hook(release)]
    hidden = torch.randn(1, 40, 16, requires_grad=True)
    labels = torch.randint(0, 50, (1, 40))
    labels[0, :3] = -100
    sources_bt = (torch.arange(40) >= 22).long()[None]  # two samples: tokens 0-21 and 22-39
    split = SourceSplit(sources_bt, [0, 1], graph=True)
    chunked_token_loss_sum(hidden, labels, head, num_chunks=3, split=split)
    weights = torch.tensor([1.0, -2.0])
    actual = torch.autograd.grad((split.graded * weights).sum(), [hidden, head.weight])
    for handle in handles:
        handle.remove()
    per_token = torch.nn.functional.cross_entropy(head(hidden)[0, :-1], labels[0, 1:], reduction="none")
    expected_sums = torch.stack([per_token[:21].sum(), per_token[21:].sum()])  # position t predicts t + 1
    expected = torch.autograd.grad((expected_sums * weights).sum(), [hidden, head.weight])
    assert torch.allclose(split.graded.detach(), expected_sums.detach(), rtol=1e-6)
    for got, want in zip(actual, expected, strict=True):
        assert float((got - want).abs().max()) <= GRAD_RTOL * float(want.abs().max())


def test_num_loss_chunks():
    assert [num_loss_chunks(m, 2048) for m in (1, 2048, 2049, 8192)] == [1, 1, 2, 4]
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        num_loss_chunks(8192, 0)


def test_a_model_that_scales_its_logits_is_refused():
    """Granite divides its logits by ``logits_scaling`` after the head: the first call names the fix."""
    config = AutoConfig.for_model(**{**TEXT, "model_type": "granite", "logits_scaling": 4.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention.register()).train()
    with pytest.raises(ValueError, match="loss_chunk_tokens=None"):
        forward_loss(model, text_samples((20, 9)), max_tokens=64, chunk_tokens=16)
    loss = forward_loss(model, text_samples((20, 9)), max_tokens=64, chunk_tokens=None)
    assert torch.isfinite(loss)


def test_liger_is_not_used_where_it_cannot_serve():
    """Not installed here (and no CUDA): the chunked path runs."""
    head = torch.nn.Linear(8, 10)
    assert liger_loss(head, None) is None and liger_loss(head, 30.0) is None
    assert HeadLoss(head, softcap=None, num_chunks=2).fused is None


