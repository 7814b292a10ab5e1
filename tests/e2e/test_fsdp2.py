"""The FSDP2 backend end to end on CPU: 2 ranks on gloo, ``launch/train.py --backend fsdp2``.

Oracles: one process's gradient of (sum of token losses) / (label tokens) with the model's own
forward on each sample alone; an uninterrupted run for resume; the checkpoint's weights for the
Hugging Face export; DeepSpeed's run of the same plan for "the outputs are the same".
"""

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import bundled_tokenizer
from launch import ROOT, Run, audit, deepspeed, ds_config, fsdp2, odb_config, sgd_step_errors, steps_trained, write_json
from odb.data.processing import DataConfig, SampleDataset
from odb.training.export import export_checkpoint
from odb.training.model.build import build_model, vision_spec
from odb.training.run.stop import EXIT_PREEMPTED
from odb.training.step.loss import token_loss_sum

TOKENIZER = bundled_tokenizer()
TINY = ROOT / "configs" / "tiny_model.json"
TINY_VL = ROOT / "configs" / "tiny_vl_model.json"
MM = ROOT / "data" / "mm" / "train.jsonl"
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())


def fsdp_config(tmp: Path, **values) -> Path:
    return write_json(tmp / "fsdp2.json", {**json.loads((ROOT / "configs" / "fsdp2.json").read_text()), **values})


def checkpoint_model(tag_folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model weights of an FSDP2 checkpoint, read in this one process (no process group)."""
    dcp_to_torch_save(tag_folder / "fsdp2", tmp / "consolidated.pt")
    return torch.load(tmp / "consolidated.pt", weights_only=False)["model"]


def check_audit(out: Path, world: int, num_samples: int) -> list[list[dict]]:
    rows = audit(out, world)
    shapes = [[(r["epoch"], r["step"], r["micro"]) for r in rank] for rank in rows]
    assert all(s == shapes[0] for s in shapes), "ranks ran different steps or micro-batches"
    assert Counter(i for rank in rows for r in rank for i in r["ids"]) == Counter(range(num_samples))
    return rows


def three_chats(tmp_path: Path) -> Path:
    """Three chats of 29, 45 and 61 tokens: with max_tokens 61 no two share a micro-batch."""
    rows = [{"messages": [{"role": "user", "content": "Repeat these words: apple river" * k},
                          {"role": "assistant", "content": "apple river " * k}]} for k in (3, 5, 7)]
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CASES = {  # model (None: a Hugging Face folder of the tiny model), data, odb max_tokens, flags, FSDP2 settings
    "text": (TINY, None, 61, (), {}),
    "text-reduce-every-micro-batch": (TINY, None, 61, (), {"reduce_every_micro_batch": True}),
    "folder": (None, None, 61, (), {}),
    "lora-checkpointing": (TINY, None, 61, ("--lora", "--gradient_checkpointing"), {}),
    "vision": (TINY_VL, MM, 1024, (), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_on_two_ranks_equals_one_process(tmp_path, case):
    """2 ranks, GAS 2, static shards, 3 samples: one SGD step (no clipping) must move every trained
    weight by lr x the gradient of (sum of token losses of the 3 samples) / (their label tokens),
    computed on one process with the model's own forward on each sample alone."""
    model_path, data, max_tokens, flags, fsdp_settings = CASES[case]
    data = data or three_chats(tmp_path)
    if model_path is None:  # rank 0 reads its weights, the other ranks only its config
        model_path = tmp_path / "folder"
        build_model(TINY, seed=5, vocab_size=len(TOKENIZER)).save_pretrained(model_path)
        TOKENIZER.save_pretrained(model_path)
    out, lr = tmp_path / "out", 1e4  # a large step: the update dominates the fp32 rounding of the weights
    fsdp2(["--backend", "fsdp2", "--fsdp_config", str(fsdp_config(tmp_path, gradient_clipping=0.0, **fsdp_settings)),
              "--model", str(model_path), "--data", str(data), "--max_samples", "3",
              "--odb_config", str(odb_config(tmp_path, max_tokens=max_tokens, window=4, gas=2, sharding="static")),
              "--output_dir", str(out), "--optimizer", "sgd", "--lr", str(lr), "--warmup_ratio", "0",
              "--audit_ids", "--num_workers", "0", *flags])
    rows = check_audit(out, 2, 3)
    assert {r["step"] for rank in rows for r in rank} == {0}  # one step
    after = checkpoint_model(out / "checkpoints" / "step1", tmp_path)

    lora = LORA if "--lora" in flags else None
    model = build_model(model_path, seed=0, vocab_size=len(TOKENIZER), lora=lora)
    model.set_attn_implementation("sdpa")  # the model's own attention, not odb's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    vision = vision_spec(model, DataConfig())
    dataset = SampleDataset(data, TOKENIZER, max_samples=3, vision=vision)
    total, label_tokens = 0.0, 0
    for i in range(3):
        sample = dataset[i]
        extra = {} if vision is None else {  # the model derives its M-RoPE positions itself
            "pixel_values": sample["pixel_values"], "image_grid_thw": sample["image_grid_thw"],
            "mm_token_type_ids": (sample["input_ids"][None] == model.config.image_token_id).int()}
        logits = model(input_ids=sample["input_ids"][None], use_cache=False, **extra).logits
        total = total + token_loss_sum(logits, sample["labels"][None])
        label_tokens += int((sample["labels"][1:] != -100).sum())
    (total / label_tokens).backward()
    moved, worst, still = sgd_step_errors(model, before, after, lr)
    print(f"FSDP2 {case}: {len(moved)} tensors moved, worst relative error {worst:.2e}; largest change of a "
          f"tensor without gradient {still:.2e}; {len(after)} tensors in the checkpoint")
    assert worst <= 1e-5 and still == 0.0
    if lora is not None:  # the checkpoint holds the trained weights only; an export merges them into --model's
        assert set(after) == {n for n, p in model.named_parameters() if p.requires_grad}
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(out / "checkpoints", tmp_path / "hf")).eval()
        model.load_state_dict(after, strict=False)
        model.eval()
        ids = dataset[0]["input_ids"][None]
        with torch.no_grad():
            gap = float((merged(input_ids=ids).logits - model(input_ids=ids, use_cache=False).logits).abs().max())
        print(f"LoRA checkpoint exported merged: largest logit difference {gap:.1e}")
        assert gap <= 1e-4


def test_a_run_is_aligned_exactly_once_resumes_exactly_exports_and_matches_deepspeed(tmp_path):
    """120 chats, 2 ranks, GAS 2: every rank runs the same steps and micro-batches and every sample
    trains once; a run stopped after 3 steps and resumed trains the same samples with the same
    losses as the uninterrupted run (model, optimizer and odb state restored); the Hugging Face
    export gives the logits of the final checkpoint's weights; DeepSpeed (ZeRO-2) on the same
    settings writes the same files with the same plan and losses."""
    common = ["--max_samples", "120", "--audit_ids", "--num_workers", "1",
              "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16, gas=2))]
    fsdp = ["--backend", "fsdp2", *common]
    full, part, ds = tmp_path / "full", tmp_path / "part", tmp_path / "ds"
    fsdp2([*fsdp, "--output_dir", str(full), "--save_hf"])
    rows = check_audit(full, 2, 120)
    fsdp2([*fsdp, "--output_dir", str(part), "--max_steps", "3", "--save_steps", "3", "--no_final_checkpoint"])
    first = audit(part, 2)
    for rank in range(2):
        (part / f"emitted_ids.rank{rank}.jsonl").rename(part / f"first.rank{rank}.jsonl")
    proc = fsdp2([*fsdp, "--output_dir", str(part), "--resume"])
    assert "resumed from" in proc.stdout
    second = audit(part, 2)
    assert [a + b for a, b in zip(first, second)] == rows  # the same micro-batches, before and after

    def losses(out: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    resumed, uninterrupted = losses(part), losses(full)
    steps = len(uninterrupted)
    assert steps > 6 and len(resumed) == steps  # metrics.jsonl continues the run
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted))
    print(f"FSDP2 resume after step 3 of {steps}: worst relative loss difference {worst:.1e}")
    assert worst <= 1e-6

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(full / "hf").eval()
    final = max((full / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))
    model = build_model(TINY, seed=0, vocab_size=len(TOKENIZER)).eval()
    model.load_state_dict(checkpoint_model(final, tmp_path))
    ids = torch.tensor([SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, max_samples=1)[0]["input_ids"].tolist()])
    with torch.no_grad():
        gap = float((exported(input_ids=ids).logits - model(input_ids=ids, use_cache=False).logits).abs().max())
    offline = AutoModelForCausalLM.from_pretrained(export_checkpoint(final, tmp_path / "offline")).eval()
    with torch.no_grad():
        offline_gap = float((exported(input_ids=ids).logits - offline(input_ids=ids).logits).abs().max())
    print(f"export: {ids.shape[1]} tokens, largest logit difference to the checkpoint {gap:.1e}, to the "
          f"checkpoint exported offline {offline_gap:.1e}")
    assert gap <= 1e-5 and offline_gap <= 1e-5

    deepspeed([*common, "--deepspeed_config", str(ds_config(tmp_path, 2)), "--output_dir", str(ds)])
    assert audit(ds, 2) == rows
    ds_losses = losses(ds)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ds_losses, uninterrupted))
    print(f"DeepSpeed ZeRO-2 vs FSDP2, {steps} steps: worst relative loss difference {worst:.1e}")
    assert len(ds_losses) == steps and worst <= 1e-5
    keys = [set(json.loads(line)) for out in (full, ds) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(k == keys[0] for k in keys)
    summaries = [json.loads((out / "summary.json").read_text()) for out in (full, ds)]
    assert set(summaries[0]) == set(summaries[1]) and summaries[0]["samples_emitted"] == 120
    assert summaries[0]["config"]["optimization"]["backend"] == "fsdp2"


def test_a_signal_stops_every_rank_at_one_step_and_the_run_resumes_on_three_ranks(tmp_path):
    """The stop, the watchdog and the resume do not know the backend: SIGUSR1 to rank 1 of 2 (each
    rank its own process, no launcher) saves one checkpoint at one step and exits 75 everywhere;
    3 ranks resume it (DCP reshards the model and optimizer, odb re-deals the samples):
    every sample exactly once, the loss goes on where it was, and a validation loss at the end."""
    out, samples = tmp_path / "out", 200
    args = ["--backend", "fsdp2", "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)),
            "--output_dir", str(out), "--audit_ids", "--max_samples", str(samples), "--dist_timeout_s", "60",
            "--eval_data", str(ROOT / "data" / "chat.jsonl")]
    run = Run([*args[:-2]], nproc=2, apart=True)  # (no validation in the stopped run)
    try:
        run.wait_for(lambda: steps_trained(out) >= 3)
        run.rank_process(1).send_signal(signal.SIGUSR1)
        codes = run.wait(90)
    finally:
        run.kill()
    assert codes == [EXIT_PREEMPTED] * 2, run.output()[-3000:]
    first = audit(out, 2)
    stopped = {max(row["step"] for row in rows) + 1 for rows in first}
    assert len(stopped) == 1 and (out / "checkpoints" / "latest").read_text() == f"step{min(stopped)}"
    before = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    proc = fsdp2([*args, "--resume"], nproc=3)
    assert "saved by 2 ranks, its untrained samples dealt to 3" in proc.stdout
    rows = [row for rank_rows in audit(out, 3) for row in rank_rows]
    assert Counter(i for row in rows for i in row["ids"]) == Counter(range(samples)), "each sample exactly once"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    after = [row["loss"] for row in rows if "loss" in row][len(before):]
    print(f"FSDP2 stopped after step {min(stopped)}: loss first {before[0]:.4f}, last 3 before {before[-3:]}, "
          f"first 3 after (3 ranks) {after[:3]}")
    assert max(after[:3]) < max(before[-3:]) + 0.3 and max(after[:3]) < before[0] - 0.3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["samples_emitted"] == samples and summary["eval_loss"] > 0
