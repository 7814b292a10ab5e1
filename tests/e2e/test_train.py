"""DeepSpeed training end to end on CPU: real launcher, 2 ranks on gloo, every ZeRO stage."""

import json
import shutil
from collections import Counter

import pytest
import torch

from conftest import bundled_tokenizer
from launch import KILLED, ROOT, audit, deepspeed, ds_config, odb_config, plain, write_json
from odb.data.processing import SampleDataset
from odb.training.model.build import build_model
from odb.training.step.loss import token_loss_sum

TOKENIZER = bundled_tokenizer()
TINY = ROOT / "configs" / "tiny_model.json"


def check_audit(out, world, num_samples, epochs=1):
    rows = audit(out, world)
    shapes = [[(r["epoch"], r["step"], r["micro"]) for r in rank] for rank in rows]
    assert all(s == shapes[0] for s in shapes), "ranks ran different steps or micro-batches"
    for epoch in range(epochs):
        ids = Counter(i for rank in rows for r in rank if r["epoch"] == epoch for i in r["ids"])
        assert ids == Counter(range(num_samples)), f"epoch {epoch} not exactly once"
    return rows


# ZeRO-2 and ZeRO-3 without LoRA train in most other e2e tests (the default ZeRO-2 config; ZeRO-3 in the
# gradient, preemption and export tests): here each stage once, LoRA at the two that partition it
@pytest.mark.parametrize("stage,lora", [(0, False), (1, False), (2, True), (3, True)])
def test_every_zero_stage_trains_aligned_and_exactly_once(tmp_path, stage, lora):
    out = tmp_path / "out"
    args = ["--deepspeed_config", str(ds_config(tmp_path, stage)),
            "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16, gas=2,
                                           sharding="static" if stage % 2 else "dynamic")),
            "--max_samples", "61", "--epochs", "2", "--output_dir", str(out), "--audit_ids",
            "--no_final_checkpoint"]
    deepspeed(args + (["--lora"] if lora else []))
    rows = check_audit(out, 2, 61, epochs=2)
    summary = json.loads((out / "summary.json").read_text())
    real = sum(1 for rank in rows for r in rank if r["ids"])
    assert summary["micro_batches"] == real and summary["samples_emitted"] == 122
    assert summary["dummy_micro_batches"] == sum(1 for rank in rows for r in rank if not r["ids"])
    assert summary["padding_ratio"] == 0 and summary["steps"] == len(rows[0]) // 2


def make_data(tmp_path):
    """Three chats of 29, 45 and 61 tokens: with max_tokens 61 no two share a micro-batch."""
    rows = [{"messages": [{"role": "user", "content": "Repeat these words: apple river" * k},
                          {"role": "assistant", "content": "apple river " * k}]} for k in (3, 5, 7)]
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("stage,flags", [
    *(pytest.param(stage, (), id=str(stage)) for stage in range(4)),
    pytest.param(2, ("--gradient_checkpointing",), id="2-checkpointing"),
    pytest.param(3, ("--gradient_checkpointing", "--lora"), id="3-checkpointing-lora")])
def test_one_step_on_two_ranks_equals_one_process(tmp_path, stage, flags):
    """2 ranks, GAS 2, static shards {2 samples} and {1 sample + 1 dummy}: one SGD step must move
    the weights as loss = (sum of token losses of all 3 samples) / (their label tokens) would, on one
    process without activation checkpointing. At ZeRO-3 the run builds the model partitioned (its
    random init must be this process's) and, with ``--gradient_checkpointing``, recomputes every layer."""
    data, out = make_data(tmp_path), tmp_path / "out"
    lr = 1e4  # a large step, so the update dominates the fp32 rounding of the weights it lands on
    proc = deepspeed(["--deepspeed_config", str(ds_config(tmp_path, stage, gradient_clipping=0.0)),
                      "--odb_config", str(odb_config(tmp_path, max_tokens=61, window=4, gas=2, sharding="static")),
                      "--data", str(data), "--output_dir", str(out), "--optimizer", "sgd", "--lr", str(lr),
                      "--warmup_ratio", "0", "--audit_ids", "--num_workers", "0", *flags])
    assert f"gradient_checkpointing {'--gradient_checkpointing' in flags}" in proc.stdout  # the start banner
    rows = check_audit(out, 2, 3)
    assert len(rows[0]) == 2 and sum(not r["ids"] for rank in rows for r in rank) == 1  # 1 step, 1 dummy
    checkpoint = out / "checkpoints"
    saved = json.loads((checkpoint / "step1" / "run_config.json").read_text())  # the resolved config
    assert saved == json.loads((out / "summary.json").read_text())["config"]
    assert saved["optimization"]["optimizer"] == "sgd" and saved["batching"]["max_tokens"] == 61
    if stage == 0:
        after = torch.load(checkpoint / "step1" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        after = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="step1")

    lora = json.loads((ROOT / "configs" / "lora.json").read_text()) if "--lora" in flags else None
    model = build_model(TINY, seed=0, vocab_size=len(TOKENIZER), lora=lora)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = SampleDataset(data, TOKENIZER)
    total, label_tokens = 0.0, 0
    for i in range(3):
        sample = dataset[i]
        total = total + token_loss_sum(model(input_ids=sample["input_ids"][None], use_cache=False).logits,
                                       sample["labels"][None])
        label_tokens += int((sample["labels"][1:] != -100).sum())
    (total / label_tokens).backward()
    with torch.no_grad():
        moved = {n: lr * p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
        worst = max(float(((after[n] - before[n]) + step).abs().max() / step.abs().max()) for n, step in moved.items())
        still = max((float((after[n] - before[n]).abs().max()) for n, _ in model.named_parameters() if n not in moved),
                    default=0.0)
    print(f"{' '.join((f'ZeRO-{stage}', *flags))}: {len(moved)} tensors moved, worst relative error {worst:.2e}; "
          f"largest change of a tensor without gradient {still:.2e}")
    assert worst <= 1e-5 and still == 0.0  # (LoRA: the frozen base, and lora_A, whose gradient is 0 while B = 0)


def test_resume_continues_with_exactly_the_samples_not_yet_trained(tmp_path):
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)),
              "--odb_config", str(odb_config(tmp_path, max_tokens=256, window=16, gas=2)),
              "--max_samples", "80", "--audit_ids", "--num_workers", "1"]
    full, part = tmp_path / "full", tmp_path / "part"
    deepspeed(common + ["--output_dir", str(full), "--no_final_checkpoint"])
    deepspeed(common + ["--output_dir", str(part), "--max_steps", "5"])
    first = audit(part, 2)
    shutil.move(part / "emitted_ids.rank0.jsonl", part / "first.rank0.jsonl")
    shutil.move(part / "emitted_ids.rank1.jsonl", part / "first.rank1.jsonl")
    # --max_steps counts the run's steps: the same command again (a requeued job) trains none; 7 trains 2 more
    again = deepspeed(common + ["--output_dir", str(part), "--resume", "--max_steps", "5"])
    assert "the run has trained 5 steps, --max_steps 5: nothing to train" in again.stdout + again.stderr
    assert [path.read_text() for path in sorted(part.glob("emitted_ids.rank*.jsonl"))] == ["", ""]
    deepspeed(common + ["--output_dir", str(part), "--resume", "--max_steps", "7"])
    middle = audit(part, 2)
    assert [sorted({r["step"] for r in rows}) for rows in middle] == [[5, 6]] * 2
    for rank in range(2):
        shutil.move(part / f"emitted_ids.rank{rank}.jsonl", part / f"middle.rank{rank}.jsonl")
    deepspeed(common + ["--output_dir", str(part), "--resume"])
    second, reference = audit(part, 2), audit(full, 2)
    k = 5
    for rank in range(2):
        assert max(r["step"] for r in first[rank]) == k - 1
        assert first[rank] + middle[rank] + second[rank] == reference[rank]  # the same batches, from step k on too
    ids = Counter(i for rows in first + middle + second for r in rows for i in r["ids"])
    assert ids == Counter(range(80))
    # the summary of the resumed run reports the whole run, as the uninterrupted one does
    whole, resumed = (json.loads((o / "summary.json").read_text()) for o in (full, part))
    for key in ("steps", "micro_batches", "dummy_micro_batches", "samples_emitted", "real_tokens",
                "materialized_tokens", "rounds", "label_tokens", "truncated_samples", "truncated_tokens", "dropped",
                "skipped"):
        assert resumed[key] == whole[key], key
    assert resumed["loss_first"] == pytest.approx(whole["loss_first"], rel=1e-4)
    assert resumed["loss_last"] == pytest.approx(whole["loss_last"], rel=1e-4)  # (this process: 2 steps)
    mine = resumed["this_process"]
    assert mine["steps"] == whole["steps"] - 7
    assert mine["samples"] == 80 - sum(len(r["ids"]) for rows in first + middle for r in rows)
    assert mine["odb_collectives"] == mine["rounds"] + 2


def test_a_deepspeed_config_that_contradicts_odb_fails_on_every_rank(tmp_path):
    """The script, with an input its flags' parsing refuses (tests/unit/test_cli_inputs.py has the
    others, in process): the message on stderr, before any process group; on 2 ranks, every rank ends."""
    bad = write_json(tmp_path / "bad.json", {"train_batch_size": 7, "zero_optimization": {"stage": 2}})
    proc = plain(["--deepspeed_config", str(bad), "--output_dir", str(tmp_path / "o")])
    assert proc.returncode != 0 and "train_batch_size=7 cannot hold" in proc.stderr
    assert "init_distributed" not in proc.stderr
    with pytest.raises(AssertionError, match="train_batch_size=7 cannot hold") as failed:  # 2 ranks: no hang
        deepspeed(["--deepspeed_config", str(bad), "--output_dir", str(tmp_path / "o")], timeout=120)
    assert KILLED not in str(failed.value)  # every rank ended by itself
