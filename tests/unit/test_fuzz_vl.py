"""A vision-language step, fuzzed: tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL, 1-2 simulated ranks,
GAS 1-2, micro-batches of 1-3 samples (images of random grids, image-and-text, text alone, a sample
with two images), dummies (the blank image alone), text-only micro-batches (a blank image added),
random label masks on the text (vision tokens never labels), the loss in chunks or from full
logits. The oracle: the model's own eager attention, own M-RoPE (from its token types) and own
``labels=`` loss on each sample alone, over the step's label tokens; checked against each rank's
summed loss and the mean over ranks of the gradients (vision tower included; what only odb's blank
image reaches is exactly 0), 1e-5 of each tensor's largest entry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import IMAGE_IDS, VL_FAMILIES, alone_forward, image_sample, pair
from test_fuzz_step import plans

from odb.training.backends import LocalBackend
from odb.training.step.engine import OdbEngine

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5
FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VISION_TOKENS = {IMAGE_IDS["image_token_id"], IMAGE_IDS["video_token_id"], IMAGE_IDS["vision_start_token_id"],
                 IMAGE_IDS["vision_end_token_id"]}
MAX_TOKENS = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def sample(draw):
    kind = draw(st.sampled_from(["image", "text", "two images"]))
    seed = draw(st.integers(0, 999))
    grid = lambda: (1, 2 * draw(st.integers(1, 4)), 2 * draw(st.integers(1, 4)))  # noqa: E731
    text = draw(st.integers(1, 20))
    if kind == "text":
        gen = torch.Generator().manual_seed(seed)
        out = {"input_ids": torch.randint(10, 1000, (text + 1,), generator=gen).tolist()}
    else:
        out = image_sample(grid(), text, seed)
        if kind == "two images":
            second = image_sample(grid(), draw(st.integers(0, 6)), seed + 1)
            out = {"input_ids": out["input_ids"] + second["input_ids"],
                   "pixel_values": torch.cat([out["pixel_values"], second["pixel_values"]]),
                   "image_grid_thw": torch.cat([out["image_grid_thw"], second["image_grid_thw"]])}
    mask = draw(st.lists(st.booleans(), min_size=len(out["input_ids"]), max_size=len(out["input_ids"])))
    out["labels"] = [t if keep and t not in VISION_TOKENS else -100 for t, keep in zip(out["input_ids"], mask,
                                                                                         strict=True)]
    return out


@st.composite
def steps(draw):
    world, gas = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ranks = [[(draw(st.lists(sample(), min_size=0, max_size=3)), False) for _ in range(gas)] for _ in range(world)]
    return {"family": draw(st.sampled_from(sorted(VL_FAMILIES))), "ranks": ranks,
            "chunk_tokens": draw(st.sampled_from([None, 7, 4096]))}


def own_loss_sum(oracle, sample: dict) -> torch.Tensor:
    labels = torch.tensor([[-100, *sample["labels"][1:]]])
    count = int((labels != -100).sum())
    if not count:
        return torch.zeros(())
    return alone_forward(oracle, sample, labels=labels)[0].loss * count


@FUZZ
@given(steps())
def test_a_fuzzed_vl_step_equals_its_samples_alone_over_the_steps_label_tokens(case):
    ranks, world = case["ranks"], len(case["ranks"])
    model, oracle = pair(case["family"])
    step_plans = plans(ranks, MAX_TOKENS)
    n_step = step_plans[0].num_label_tokens
    objective = torch.zeros(())
    for rank, plan in zip(ranks, step_plans, strict=True):
        engine = OdbEngine(LocalBackend(model), world_size=world, max_tokens=MAX_TOKENS, pad_token_id=0,
                           loss_chunk_tokens=case["chunk_tokens"])
        result = engine.train_step(plan, [samples for samples, _ in rank], lr=0.0)
        own = [own_loss_sum(oracle, s) for samples, _ in rank for s in samples]
        expected = float(sum(float(x.detach()) for x in own))
        assert abs(result.loss_sum - expected) <= LOSS_RTOL * max(expected, 1.0), (result.loss_sum, expected)
        if n_step:
            objective = objective + sum(own, torch.zeros(())) / n_step
    if objective.requires_grad:
        objective.backward()
    theirs = dict(oracle.named_parameters())
    for name, param in model.named_parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad
        want = torch.zeros_like(param) if theirs[name].grad is None else theirs[name].grad
        scale = max(float(want.abs().max()), 1e-2)  # (abs 1e-7: rounding, where a gradient is 0 in exact maths)
        diff = float((grad / world - want).abs().max())
        assert diff <= GRAD_RTOL * scale, f"{case['family']}: gradient of {name} off by {diff:.2e} (scale {scale:.2e})"
