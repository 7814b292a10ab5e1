"""Preference pairs on a vision-language model (tiny Qwen2-VL and Qwen2.5-VL): a pair whose prompt
holds an image carries it in both sequences (odb.data.preference.pair_sequences), each sequence
its own segment of the packed row with its own M-RoPE and its image's tokens from one vision-tower
call; a micro-batch of text-only pairs gets odb's blank image; a dummy. The oracle: the model's own
eager attention, its own M-RoPE from the token types and its own logits on each sequence alone
(tests/unit/test_attention.alone_forward), each answer's summed log-probability, TRL's own loss
code on each pair (tests/preference_oracle.py), the mean over the step's pairs: the step's loss
and every gradient (the vision tower's included) must agree."""

from __future__ import annotations

import random

import pytest
import torch
from test_attention import alone_forward, image_sample
from test_attention import pair as model_pair
from test_preference_loss import check_equal, plan_of

from odb.data.preference import pair_sequences
from odb.training.backends import LocalBackend
from odb.training.step.engine import OdbEngine
from odb.training.step.preference import Preference
from preference_oracle import trl_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def vl_pair(rng: random.Random, uid: int, *, image: bool) -> dict:
    """A pair sample as odb.data.preference makes one for a VL model: the prompt (an image of a
    random grid and some text, or text alone) in both sequences, each answer its labels."""
    grid = (1, 2 * rng.randint(1, 3), 2 * rng.randint(1, 3))
    prompt = image_sample(grid, rng.randint(1, 8), uid) if image else \
        {"input_ids": [rng.randrange(10, 1000) for _ in range(rng.randint(2, 9))]}
    ids, labels = [], []
    for _ in range(2):
        answer = [rng.randrange(10, 1000) for _ in range(rng.choice([1, 4, 30]))]
        ids.append(prompt["input_ids"] + answer)
        labels.append([-100] * len(prompt["input_ids"]) + answer)
    sample = {"uid": uid, "index": uid, "source": 0, "input_ids": torch.tensor(ids[0] + ids[1]),
              "labels": torch.tensor(labels[0] + labels[1]), "pair": (len(ids[0]), len(ids[1])),
              "ref_logps": (-rng.uniform(5, 300), -rng.uniform(5, 300)), "patches": 0}
    if image:
        sample.update(pixel_values=torch.cat([prompt["pixel_values"]] * 2),
                      image_grid_thw=torch.cat([prompt["image_grid_thw"]] * 2), patches=2 * len(prompt["pixel_values"]))
    return sample


def alone_logps(model, sample: dict) -> list[torch.Tensor]:
    out = []
    for seq in pair_sequences(sample):
        seq = {k: v.tolist() if k in ("input_ids", "labels") else v for k, v in seq.items()}
        logits, _ = alone_forward(model, seq)
        targets = torch.tensor(seq["labels"][1:])
        scored = targets != -100
        out.append(torch.log_softmax(logits[0, :-1].float(), -1)[scored].gather(1, targets[scored][:, None]).sum())
    return out


@pytest.mark.parametrize(("family", "loss"), [("qwen2_vl", "dpo"), ("qwen2_5_vl", "simpo")])
def test_packed_vl_pairs_train_trls_loss_of_each_pair_alone(family, loss):
    rng = random.Random(11)
    samples = [vl_pair(rng, uid, image=uid != 3) for uid in range(5)]  # (pair 3: text alone)
    micro_samples = [samples[:3], [samples[3]], samples[4:]]  # (the second gets the blank image)
    reference = "data" if loss == "dpo" else "none"
    beta = 0.1 if loss == "dpo" else 2.0
    objective = Preference(loss, beta=beta, gamma=0.5, reference=reference)
    model, oracle = model_pair(family)
    model.zero_grad()
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=512, pad_token_id=0, loss_chunk_tokens=64,
                       objective=objective)
    plan = plan_of(micro_samples)
    tally = engine.tally(plan)
    for micro, micro_batch in zip(plan.micro_batches, [*micro_samples, []], strict=True):
        tally.loss(micro, micro_batch).backward()
    result = tally.result(lr=0.0)
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    total = 0
    for sample in samples:
        pi = alone_logps(oracle, sample)
        n = [int((s["labels"][1:] != -100).sum()) for s in pair_sequences(sample)]
        rho = [torch.tensor(v) for v in sample["ref_logps"]] if reference == "data" else None
        total = total + trl_loss(loss, beta, 0.5, pi, rho, n)
    mean = total / len(samples)
    mean.backward()
    want = {name: p.grad for name, p in oracle.named_parameters() if p.grad is not None}
    assert result.loss_sum / len(samples) == pytest.approx(float(mean), rel=1e-5)
    assert any("visual" in name and want[name].abs().sum() > 0 for name in want)  # the image's gradient reaches it
    # (the blank image's patches reach the vision tower in odb's packed call only: what only they
    # reach has gradient 0 and is not in the oracle's)
    check_equal({k: v for k, v in got.items() if k in want or v.abs().max() > 0}, want)
