"""Exact eval loss (odb/training/run/evaluate.py) against an oracle that shares none of its code.

The oracle: one process, no DeepSpeed, no packing, the same weights in a model with
``attn_implementation="eager"``; each eval sample alone through it, the cross entropy of its labels
(shifted inside the sample) summed in float64 over every sample, / the label tokens. The evaluator
must give the same number to 1e-6 on simulated ranks (any world size, packed or one sample per
micro-batch, skipped, dropped and truncated records) and on 1 and 2 ZeRO-3 ranks under the
DeepSpeed backend (tests/e2e/eval_worker.py), text and a tiny Qwen2-VL with images.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from conftest import bundled_tokenizer
from launch import ROOT, deepspeed, write_json
from odb.batching.config import OdbConfig
from odb.batching.simulate import run_ranks
from odb.data.feed import DataError
from odb.data.processing import DataConfig, SampleDataset
from odb.training.model.build import build_model, vision_spec
from odb.training.run.evaluate import Evaluator
from odb.training.step.engine import OdbEngine
from video_data import model_inputs

TOKENIZER = bundled_tokenizer()
TINY, VL = ROOT / "configs" / "tiny_model.json", ROOT / "configs" / "tiny_vl_model.json"
CHATS, MM = ROOT / "data" / "chat.jsonl", ROOT / "data" / "mm"
WORKER = Path(__file__).resolve().parent / "eval_worker.py"
TOLERANCE = 1e-6
IMAGE_TOKEN = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")


# ---- the oracle ---------------------------------------------------------------------------------

def oracle(model_path: Path, weights: dict[str, torch.Tensor], samples: list[dict], *,
           max_tokens: int | None = None) -> tuple[float, int]:
    """``(sum of CE over every label / label tokens, label tokens)``: each sample alone (its first
    ``max_tokens`` tokens) through an eager model, float64."""
    config = AutoConfig.for_model(**json.loads(model_path.read_text()))
    is_vl = getattr(config, "vision_config", None) is not None
    model = (AutoModelForImageTextToText if is_vl else AutoModelForCausalLM).from_config(
        config, attn_implementation="eager").eval()
    model.load_state_dict(weights)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids, labels = sample["input_ids"][:max_tokens][None], sample["labels"][:max_tokens]
            inputs = {"input_ids": ids}
            if sample.get("pixel_values_videos") is not None:
                assert max_tokens is None
                inputs = model_inputs(sample)  # (with its images)
            elif sample.get("pixel_values") is not None:
                inputs.update(pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"],
                              mm_token_type_ids=(ids == IMAGE_TOKEN).int())
            logits = model(**inputs, use_cache=False).logits[0].double()
            total += float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"))
            tokens += int((labels[1:] != -100).sum())
    return (total / tokens if tokens else math.nan), tokens


@functools.cache
def initial_weights(model_path: Path) -> dict[str, torch.Tensor]:
    return build_model(model_path, seed=0, vocab_size=len(TOKENIZER)).state_dict()


# ---- simulated ranks: the evaluator over a plain model -------------------------------------------

class LocalEngine:
    """What OdbEngine uses of a DeepSpeed engine, over a plain model (no ZeRO); notes each forward's
    training mode, whether gradients were on, and how many samples (or padded rows) it held."""

    def __init__(self, model) -> None:
        self.module, self.device, self.forwards = model, torch.device("cpu"), []

    def __call__(self, **batch):
        cu_seqlens = batch.get("cu_seq_lens_q")
        rows = len(cu_seqlens) - 1 if cu_seqlens is not None else len(batch["input_ids"])
        self.forwards.append((self.module.training, torch.is_grad_enabled(), rows))
        return self.module(**batch)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def release_cache(self) -> None:  # DeepSpeed's releases ZeRO-3's gathered parameters
        pass


@functools.cache
def text_model():
    return build_model(TINY, seed=0, vocab_size=len(TOKENIZER))


def simulate(world: int, dataset, batching: OdbConfig, *, training: bool = True):
    """Runs the evaluator on ``world`` simulated ranks, each with its own copy of the model."""
    engines = [LocalEngine(copy.deepcopy(text_model()).train(training)) for _ in range(world)]

    def rank(comm):
        engine = OdbEngine(engines[comm.rank], world_size=world, max_tokens=batching.max_tokens,
                           pad_token_id=TOKENIZER.pad_token_id)
        return Evaluator(engine, dataset, batching, comm).run()

    return run_ranks(world, rank), engines


def check_simulated(results, engines, expected: tuple[float, int], samples: int) -> float:
    assert all(r == results[0] for r in results), "ranks returned different results"
    counts = [len(e.forwards) for e in engines]
    assert len(set(counts)) == 1, f"ranks ran different numbers of forwards: {counts}"
    assert not any(f[0] or f[1] for e in engines for f in e.forwards), "a forward in train mode or with grad"
    assert all(e.module.training for e in engines), "train mode not restored"
    result, (loss, tokens) = results[0], expected
    print(f"  simulated world {len(engines)}: loss {result.loss:.12f}, oracle {loss:.12f}, "
          f"diff {result.loss - loss:+.2e}")
    assert abs(result.loss - loss) <= TOLERANCE
    assert result.label_tokens == tokens and result.samples == samples
    return result.loss


def chats(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


BATCHINGS = {  # packed; one sample per micro-batch (fixed batch 1); training in quota mode, static shards
    "packed": OdbConfig(max_tokens=2048, window=16),
    "single": OdbConfig(policy="fixed", batch_size=1, window=4, sharding="static"),
    "quota_static": OdbConfig(mode="quota", quota=5, sharding="static", max_tokens=600, window=8),
}


@pytest.mark.sim
@pytest.mark.parametrize("world", [1, 2, 3])
def test_simulated_ranks_give_the_oracle_loss(world):
    dataset = SampleDataset(CHATS, TOKENIZER, max_samples=24, truncate_to=600)
    samples = [dataset[i] for i in range(len(dataset))]
    expected = oracle(TINY, initial_weights(TINY), samples)
    for name, batching in BATCHINGS.items():
        results, engines = simulate(world, dataset, batching)
        check_simulated(results, engines, expected, len(dataset))
        rows = [f[2] for e in engines for f in e.forwards]
        assert max(rows) == 1 if name == "single" else max(rows) > 1


@pytest.mark.sim
@pytest.mark.parametrize("world", [1, 3])
def test_samples_over_the_cap_are_scored_whole_so_the_loss_does_not_depend_on_max_tokens(tmp_path, world):
    """The eval loss was over each sample's first ``max_tokens`` tokens (the README said it did not
    depend on ``max_tokens``; at 512 and 256 it did). Now every sample is scored whole, under every
    over-cap policy and cap: the oracle is each sample alone, whole, through the eager model; skipped
    records are counted, and each rank runs as many forwards as the others (the over-cap samples
    sit on some ranks only)."""
    lines = (CHATS.read_text().splitlines())[:12]
    lines += [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) for i in range(3)]
    lines += ["{not json"]
    dataset = SampleDataset(chats(tmp_path, lines), TOKENIZER)  # not truncated by the data layer
    records = [dataset[i] for i in range(len(dataset))]
    samples = [s for s in records if "skip" not in s]
    expected = oracle(TINY, initial_weights(TINY), samples)
    losses = set()
    for cap, policy in [(150, "drop"), (150, "truncate"), (150, "error"), (90, "truncate"), (2048, "truncate")]:
        over = sum(len(s["input_ids"]) > cap for s in samples)
        assert (0 < over < len(samples)) if cap < 2048 else not over
        results, engines = simulate(world, dataset, OdbConfig(max_tokens=cap, window=8, over_cap=policy))
        losses.add(check_simulated(results, engines, expected, len(samples)))
        assert results[0].skipped == {"no_assistant_turn": 3, "not_json": 1}
        assert results[0].over_cap == over
        whole = [f for e in engines for f in e.forwards if f[2] == 1]
        assert len(whole) >= over, "each sample over the cap in a forward of its own"
    print(f"  world {world}: the loss at every cap and policy: {sorted(losses)}")
    assert max(losses) - min(losses) <= TOLERANCE


@pytest.mark.sim
def test_no_label_tokens_gives_no_loss_and_an_error_restores_the_mode_it_found(tmp_path):
    no_answers = [json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) for i in range(5)]
    results, engines = simulate(2, SampleDataset(chats(tmp_path, no_answers), TOKENIZER), OdbConfig(window=4))
    assert results[0].loss is None and results[0].label_tokens == results[0].samples == 0
    assert results[0].skipped == {"no_assistant_turn": 5}
    bad = SampleDataset(chats(tmp_path, CHATS.read_text().splitlines()[:6] + ["{not json"]), TOKENIZER,
                        DataConfig(strict=True))
    for training in (True, False):  # a model loaded with from_pretrained comes in eval mode: it stays there
        engines = [LocalEngine(copy.deepcopy(text_model()).train(training)) for _ in range(2)]

        def rank(comm, engines=engines):
            engine = OdbEngine(engines[comm.rank], world_size=2, max_tokens=512, pad_token_id=0)
            return Evaluator(engine, bad, OdbConfig(max_tokens=512, window=4), comm).run()

        with pytest.raises(DataError, match="not_json"):
            run_ranks(2, rank)
        assert [e.module.training for e in engines] == [training, training]


# ---- real ranks: ZeRO-3, a process per rank (tests/launch.py deepspeed()) -------------------------

def launch(tmp_path: Path, scenario: dict, nproc: int) -> list[dict]:
    """Runs eval_worker.py on ``nproc`` CPU ranks; every rank's JSON. The launch must leave no
    DeepSpeed shared memory behind."""
    out = tmp_path / f"out{nproc}"
    out.mkdir()
    path = write_json(tmp_path / f"scenario{nproc}.json", {**scenario, "out": str(out)})
    deepspeed([str(path)], nproc=nproc, timeout=300, script=WORKER)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    if scenario.get("train_lr"):
        ranks[0]["weights"] = torch.load(out / "weights.pt")
    return ranks


def check_launch(ranks: list[dict], expected: dict[str, tuple[float, int]], size: int) -> dict[str, float]:
    """Every eval against its oracle, and the invariants each rank recorded; the losses by name."""
    world, losses = len(ranks), {}
    for e, first in enumerate(ranks[0]["evals"]):
        name, result = first["name"], first["result"]
        evals = [rank["evals"][e] for rank in ranks]
        assert all(ev["result"] == result for ev in evals), f"{name}: ranks returned different results"
        steps = [ev["steps"] for ev in evals]
        assert len({len(s) for s in steps}) == 1, f"{name}: ranks ran different numbers of steps"
        assert all(len(step["sizes"]) == 1 for s in steps for step in s)  # gas 1
        ids = Counter(i for s in steps for step in s for i in step["ids"])
        assert ids == Counter(range(size)), f"{name}: not every sample exactly once"
        assert all(step["forwards"] == [[False, False]] for s in steps for step in s), "one forward, eval, no grad"
        assert all(ev["training_after"] and ev["children_after"] == 0 for ev in evals)
        sizes = [n for s in steps for step in s for n in step["sizes"]]
        if name == "single":
            assert max(sizes) == 1, "one sample per micro-batch"
            assert sizes.count(0) == world * len(steps[0]) - size  # the dummies that align the ranks
        if name in ("packed", "after_train"):
            assert max(sizes) > 1, "packed"
        workers = [max(step["children"] for step in s) for s in steps]  # the eval feed's, while it ran
        assert all(bool(n) == bool(first["num_workers"]) for n in workers), (name, workers)
        loss, tokens = expected[name]
        print(f"  world {world} {name}: loss {result['loss']:.12f}, oracle {loss:.12f}, "
              f"diff {result['loss'] - loss:+.2e}")
        assert abs(result["loss"] - loss) <= TOLERANCE
        assert result["label_tokens"] == tokens and result["samples"] == size and not result["skipped"]
        assert (result["over_cap"] > 0) == (name == "over_cap"), (name, result["over_cap"])
        losses[name] = result["loss"]
    return losses


EVALS = [{"name": "packed", "batching": {"max_tokens": 2048, "window": 16}},
         {"name": "single", "batching": {"policy": "fixed", "batch_size": 1, "window": 4, "sharding": "static"},
          "num_workers": 1},
         {"name": "quota_static", "num_workers": 2,
          "batching": {"mode": "quota", "quota": 5, "sharding": "static", "max_tokens": 600, "window": 8}},
         # samples over the cap scored whole, each in a forward of its own (dummies on the other rank)
         {"name": "over_cap", "batching": {"max_tokens": 256, "window": 16}}]


def test_eval_loss_on_one_and_two_zero3_ranks_equals_the_oracle(tmp_path):
    """41 chats (static shards of 21 and 20: the 2-rank one-sample-per-micro-batch eval has a dummy);
    four evals (one with a cap of 256 tokens that some samples exceed: scored whole all the same),
    one SGD step, the first eval again against the oracle on the gathered weights."""
    size = 41
    scenario = {"model": str(TINY), "data": str(CHATS), "max_samples": size, "image_folder": None,
                "train_lr": 1.0, "evals": EVALS}
    dataset = SampleDataset(CHATS, TOKENIZER, max_samples=size)
    samples = [dataset[i] for i in range(size)]
    assert max(len(s["input_ids"]) for s in samples) <= 600  # no truncation anywhere
    before = oracle(TINY, initial_weights(TINY), samples)
    losses = {}
    for world in (1, 2):
        ranks = launch(tmp_path, scenario, world)
        after = oracle(TINY, ranks[0]["weights"], samples)
        assert abs(after[0] - before[0]) > 1e-2  # the training step moved the weights
        expected = {**{spec["name"]: before for spec in EVALS}, "after_train": after}
        losses[world] = check_launch(ranks, expected, size)
    for name in ("packed", "single", "quota_static", "over_cap"):
        print(f"  world 1 vs 2 {name}: diff {losses[1][name] - losses[2][name]:+.2e}")
        assert abs(losses[1][name] - losses[2][name]) <= TOLERANCE


def test_vision_language_eval_on_two_zero3_ranks_equals_the_oracle(tmp_path):
    """A tiny Qwen2-VL, 11 records with images and 4 without (a blank image joins their micro-batch
    when it has none of its own), packed and one sample per micro-batch (with a dummy)."""
    lines = (MM / "train.jsonl").read_text().splitlines()[:11] + CHATS.read_text().splitlines()[:4]
    data = chats(tmp_path, lines)
    size, folder = len(lines), str(MM)
    evals = [{"name": "packed", "batching": {"max_tokens": 1024, "window": 16}},
             {"name": "single", "batching": {"policy": "fixed", "batch_size": 1, "window": 4, "sharding": "static"}}]
    ranks = launch(tmp_path, {"model": str(VL), "data": str(data), "max_samples": size, "image_folder": folder,
                              "train_lr": None, "evals": evals}, 2)
    weights = initial_weights(VL)
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER))
    config = DataConfig(image_folder=folder)
    dataset = SampleDataset(data, TOKENIZER, config, vision=vision_spec(model, config))
    samples = [dataset[i] for i in range(size)]
    assert sum(s.get("pixel_values") is not None for s in samples) == 11
    assert max(len(s["input_ids"]) for s in samples) <= 1021  # no truncation (1024 - the blank image)
    expected = oracle(VL, weights, samples)
    losses = check_launch(ranks, {"packed": expected, "single": expected}, size)
    assert abs(losses["packed"] - losses["single"]) <= TOLERANCE


def test_video_eval_on_two_zero3_ranks_equals_the_oracle(tmp_path):
    """A tiny Qwen3-VL with a video token: a video file, a frame folder, an image with two videos,
    an image and text, twice over with chats between; packed and one sample per micro-batch. The
    oracle scores each sample alone with its videos as videos (the model's own M-RoPE)."""
    from video_data import (
        RECORDS,
        SMALL,
        VIDEO_TOKENIZER,
        config_file,
        data_config_file,
        tokenizer_folder,
        write_records,
    )

    data = write_records(tmp_path, RECORDS + RECORDS[::-1])
    lines = data.read_text().splitlines() + CHATS.read_text().splitlines()[:3]
    data.write_text("\n".join(lines) + "\n")
    size, model_path = len(lines), config_file(tmp_path, "qwen3_vl")
    evals = [{"name": "packed", "batching": {"max_tokens": 1024, "window": 16}},
             {"name": "single", "batching": {"policy": "fixed", "batch_size": 1, "window": 4, "sharding": "static"}}]
    settings = json.loads(data_config_file(tmp_path).read_text())
    ranks = launch(tmp_path, {"model": str(model_path), "tokenizer": str(tokenizer_folder(tmp_path)),
                              "data": str(data), "max_samples": size, "image_folder": None, "data_config": settings,
                              "train_lr": None, "evals": evals}, 2)
    model = build_model(model_path, seed=0, vocab_size=len(VIDEO_TOKENIZER))
    dataset = SampleDataset(data, VIDEO_TOKENIZER, SMALL, vision=vision_spec(model, SMALL))
    samples = [dataset[i] for i in range(size)]
    assert sum(s.get("pixel_values_videos") is not None for s in samples) == 6
    expected = oracle(model_path, model.state_dict(), samples)
    losses = check_launch(ranks, {"packed": expected, "single": expected}, size)
    assert abs(losses["packed"] - losses["single"]) <= TOLERANCE
