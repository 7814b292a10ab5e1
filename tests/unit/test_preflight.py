"""The preflight's pieces in one process: its memory probe against known allocations, its
worst-case micro-batches, and a probe step that leaves training as it was (the real engine's
probe_step and train_step on a real model and torch AdamW, against the same model trained without
the probe). The whole preflight under DeepSpeed and FSDP2: tests/e2e/test_preflight_launch.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_attention import build

from conftest import one_step_plan
from odb.training import attention
from odb.training.backends.base import optimizer_kept_fresh
from odb.training.run.preflight import PreflightError, measure, preflight
from odb.training.run.worst_case import PACKED_SAMPLES, image_sample, special_token_ids, worst_case_batches
from odb.training.step.engine import OdbEngine

CPU = torch.device("cpu")


@pytest.mark.parametrize("megabytes", [64, 256])
def test_the_cpu_probe_measures_what_a_step_allocates(megabytes):
    def step():
        block = torch.ones(megabytes * 2**20 // 4)  # written, so resident
        assert float(block[-1]) == 1.0

    peak, seconds = measure(step, CPU)
    assert megabytes * 0.95 <= peak <= megabytes * 1.25, peak
    assert seconds > 0
    quiet, _ = measure(lambda: None, CPU)  # the high-water mark starts again at every step
    assert quiet < 8, quiet


def test_the_worst_case_micro_batches_hold_the_budget_and_avoid_special_tokens():
    avoid = {3, 5, 7}
    one, packed = worst_case_batches(1000, vocab_size=16, avoid=avoid)
    assert [len(s["input_ids"]) for s in one] == [1000]
    assert len(packed) == PACKED_SAMPLES and sum(len(s["input_ids"]) for s in packed) == 1000
    for sample in one + packed:
        ids = set(sample["input_ids"].tolist())
        assert not ids & avoid and ids <= set(range(16))
        assert torch.equal(sample["labels"], sample["input_ids"])  # every label counts
    small = worst_case_batches(3, vocab_size=16, avoid=set())[1]
    assert [len(s["input_ids"]) for s in small] == [1, 1, 1]


def test_a_vision_model_s_worst_case_opens_with_its_images():
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2_vl", vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2},
                                  vision_start_token_id=1001, vision_end_token_id=1002, image_token_id=1003)
    image = image_sample(config, image_patches=64, images=2)
    merge = config.vision_config.spatial_merge_size
    assert image["patches"] == 128 and image["pixel_values"].shape[0] == 128
    assert int((image["input_ids"] == 1003).sum()) == 128 // merge ** 2
    assert {1001, 1002, 1003} <= special_token_ids(config)
    one, _ = worst_case_batches(200, vocab_size=1000, avoid=special_token_ids(config), visual=[image])
    assert len(one[0]["input_ids"]) == 200 and torch.equal(one[0]["input_ids"][:len(image["input_ids"])],
                                                           image["input_ids"])
    assert int((one[0]["labels"] != -100).sum()) == 200 - len(image["input_ids"])


class TorchBackend:
    """One process, a torch AdamW: what DeepSpeed's and FSDP2's backends do around their engines,
    without the ranks."""

    name = "torch"

    def __init__(self, model):
        self.module, self.device = model, CPU
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def __call__(self, **batch):
        return self.module(**batch)

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, loss, *, sync):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(list(self.module.parameters()), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode=True):
        self.module.train(mode)

    def pristine(self):
        return optimizer_kept_fresh(self.optimizer)


def test_a_probe_step_leaves_the_first_real_steps_as_they_would_have_been():
    """Two copies of a model with dropout: one runs the preflight (its worst-case steps inside
    pristine()), then both train the same two steps from the same seed; losses, weights and AdamW's
    state agree exactly with the copy that never saw the preflight."""
    torch.manual_seed(0)
    model = build("llama", attention.register(), attention_dropout=0.5)
    copies = {"probed": copy.deepcopy(model), "plain": copy.deepcopy(model)}
    engines = {name: OdbEngine(TorchBackend(m), world_size=1, max_tokens=256, pad_token_id=0, loss_chunk_tokens=64)
               for name, m in copies.items()}
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(vocab, (n,), generator=generator)} for n in (40, 90, 17)]
    losses = {}
    for name, engine in engines.items():
        torch.manual_seed(7)
        if name == "probed":
            gathered = []
            with engine.backend.pristine():
                report = preflight(lambda batch, budget: engine.probe_step(batch), budget=256, upper=256,
                                   gather=lambda v: (gathered.append(v), np.asarray(v)[None])[1], device=CPU,
                                   cap_mb=1e6, world_size=1, vocab_size=vocab, avoid=set(), log=lambda _: None)
                assert engine.backend.optimizer.state  # the probe steps made AdamW's state
            assert not engine.backend.optimizer.state and report.max_tokens == 256 and len(gathered) == 2
        losses[name] = [engine.train_step(one_step_plan([samples]), [samples], 1e-3).loss_sum for _ in range(2)]
    assert losses["probed"] == losses["plain"] and losses["plain"][0] != losses["plain"][1]
    weights = [m.state_dict() for m in copies.values()]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    states = [engines[n].backend.optimizer.state_dict()["state"] for n in copies]
    assert states[0].keys() == states[1].keys() and states[0]
    for key in states[0]:
        assert all(torch.equal(torch.as_tensor(states[0][key][k]), torch.as_tensor(states[1][key][k]))
                   for k in states[0][key])


def test_a_fixed_budget_over_the_cap_names_the_largest_that_fits():
    """The probe's measure is real (the CPU's resident memory): a step allocating 1 MiB per token of
    budget over a 300 MiB cap fits at about 300 tokens, not at 1024."""
    def step(samples, budget):
        block = torch.ones(budget * 2**18)  # 1 MiB a token
        assert float(block[-1]) == 1.0

    gather = lambda v: np.asarray(v)[None]  # noqa: E731 (one rank)
    with pytest.raises(PreflightError) as failed:
        preflight(step, budget=1024, upper=4096, gather=gather, device=CPU, cap_mb=300, world_size=1, vocab_size=32,
                  avoid=set(), log=lambda _: None)
    message = str(failed.value)
    assert "max_tokens 1024" in message and "set max_tokens" in message
    named = int(message.split("set max_tokens ")[1].split()[0])
    assert named == 256, message  # 256 MiB fits a 300 MiB cap; 320 MiB does not
    report = preflight(step, budget="auto", upper=1024, gather=gather, device=CPU, cap_mb=300, world_size=1,
                       vocab_size=32, avoid=set(), log=lambda _: None)
    assert report.max_tokens == named and report.trials[-1]["max_tokens"] in (named, named + 64)
    fitting = [t["max_tokens"] for t in report.trials if t["fits"]]
    assert max(fitting) == report.max_tokens
    assert any(t["max_tokens"] == report.max_tokens + 64 and not t["fits"] for t in report.trials)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_vision_model_s_worst_case_runs_its_images_through_the_engine(family):
    """The preflight of a vision model: its largest images (as many as half the budget holds) in
    the one-sample shape, a blank image in the text-only packed one, through the real engine; the
    zero-weight backward reaches the vision tower (every gradient there exists and is 0)."""
    from odb.training.backends import LocalBackend
    from odb.training.model.build import hf_model
    from odb.training.run.worst_case import worst_images

    model = build(family, attention.register())
    config = hf_model(model).config
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=400, pad_token_id=0)
    merge2 = config.vision_config.spatial_merge_size ** 2
    report = preflight(lambda batch, budget: engine.probe_step(batch), budget=400, upper=400,
                       gather=lambda v: np.asarray(v)[None], device=CPU, cap_mb=1e6, world_size=1,
                       vocab_size=model.get_input_embeddings().num_embeddings, avoid=special_token_ids(config),
                       visual=lambda budget: [worst_images(config, budget, largest_image=16 * merge2,
                                                           max_patches=None)],
                       log=lambda _: None)
    assert report.max_tokens == 400 and report.max_patches == 11 * 16 * merge2  # (200 tokens) // (16 + 2) images
    vision = [p for name, p in model.named_parameters() if "visual" in name]
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision)


def test_the_special_tokens_of_a_config_with_several_end_tokens(monkeypatch):
    """Llama-3.1's eos_token_id is a list: text ids all the same; an image token is special."""
    from transformers import AutoConfig

    from odb.training.run.preflight import local_ranks

    config = AutoConfig.for_model("llama", eos_token_id=[5, 6], bos_token_id=4, pad_token_id=None)
    config.image_token_id = 9
    assert special_token_ids(config) == {9}
    for env, expected in (({"LOCAL_WORLD_SIZE": "4"}, 4), ({"LOCAL_SIZE": "3", "WORLD_SIZE": "8"}, 3),
                          ({"WORLD_SIZE": "2"}, 2), ({}, 1)):
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert local_ranks() == expected, env


def test_under_over_cap_sequence_parallel_each_trial_runs_the_largest_group_s_slice():
    """long=4 (over_cap 'sequence_parallel', groups of up to 4): besides the budget's two shapes,
    every trial runs a sample of 4 x the budget, all its labels counting, as a slice on a group of
    4; cut as sequence parallelism cuts it (SequenceParallel.shard), each of the 4 ranks holds a
    budget's tokens of it (and attends over all 4 x 256 for a quarter of the heads: the real
    attention's sizes on 2 ranks, tests/e2e/test_preflight_launch.py)."""
    from odb.data.collate import collate_packed
    from odb.training.step.sequence_parallel import SequenceParallel

    calls = []
    report = preflight(lambda samples, budget, degree=1: calls.append((samples, budget, degree)), budget=256,
                       upper=256, gather=lambda v: np.asarray(v)[None], device=CPU, cap_mb=1e6, world_size=4,
                       vocab_size=64, avoid=set(), log=lambda _: None, long=4)
    assert report.max_tokens == 256 and [(b, d) for _, b, d in calls] == [(64, 1), (256, 1), (256, 1), (256, 4)]
    (long,), budget, degree = calls[-1]
    assert len(long["input_ids"]) == 4 * 256 and torch.equal(long["labels"], long["input_ids"])
    batch = collate_packed([long])
    labels = batch.pop("labels")
    slices = [SequenceParallel(size=4, member=m, group=None).shard(batch, labels, pad_token_id=0)[0]["input_ids"]
              for m in range(4)]
    assert [s.shape[1] for s in slices] == [256] * 4 and torch.equal(torch.cat(slices, dim=1)[0], long["input_ids"])
    assert max(len(s["input_ids"]) for samples, _, _ in calls[1:-1] for s in samples) == 256  # the shapes alone
