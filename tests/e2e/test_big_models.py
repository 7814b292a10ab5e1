"""Models too big for one rank: built partitioned at ZeRO-3, in the training precision, with
activation checkpointing.

The oracle of a partitioned build is the same model built whole in one process (a seed's random
init, a saved folder); the oracle of activation checkpointing is the same step without it. The
2-rank checks run in tests/e2e/big_models_worker.py; tools/bench/bench_load.py measures the memory.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import bundled_tokenizer
from launch import ROOT, deepspeed
from odb.data.collate import collate_packed
from odb.data.processing import DataConfig, SampleDataset
from odb.training.backends.deepspeed_config import training_dtype
from odb.training.launch.flags import FileDefaults, parse_config
from odb.training.model.build import build_model, vision_spec
from odb.training.model.mrope import packed_position_ids

TOKENIZER = bundled_tokenizer()
VL = ROOT / "configs" / "tiny_vl_model.json"
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())
WORKER = Path(__file__).resolve().parent / "big_models_worker.py"


def launch(script: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return deepspeed(list(args), timeout=timeout, script=script)


def test_training_dtype_follows_the_resolved_deepspeed_config():
    assert training_dtype(None) == torch.float32
    assert training_dtype({"bf16": {"enabled": True}}) == torch.bfloat16
    assert training_dtype({"bfloat16": {"enabled": True}}) == torch.bfloat16
    assert training_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == torch.float16
    assert training_dtype({"bf16": {"enabled": "auto"}}) == torch.float32  # unresolved: never guessed


def test_the_gradient_checkpointing_flag_reaches_the_run_config(tmp_path):
    configs = ROOT / "configs"
    defaults = FileDefaults(deepspeed_config=configs / "ds_zero3.json", odb_config=configs / "odb.json",
                            model=configs / "tiny_model.json", data=ROOT / "data" / "chat.jsonl",
                            tokenizer=ROOT / "data" / "tokenizer", lora=configs / "lora.json")
    fresh = ["--output_dir", str(tmp_path / "run")]  # (not runs/default, which a README run may have filled)
    assert not parse_config(fresh, defaults=defaults).model.gradient_checkpointing
    config = parse_config(["--gradient_checkpointing", *fresh], defaults=defaults)
    assert config.model.gradient_checkpointing and config.to_dict()["model"]["gradient_checkpointing"] is True


def test_zero3_builds_partitioned_the_model_one_process_builds_whole(tmp_path):
    """2 ranks: random init (text, LoRA, Qwen2-VL) and saved folders, each gathered tensor equal to
    the whole build; bf16 / fp16 configs build in their precision; one SGD step with activation
    checkpointing (every layer and vision block recomputed) equals the step without it."""
    launch(WORKER, str(tmp_path))
    ranks = json.loads((tmp_path / "report.json").read_text())
    print("partitioned build:", {k: v for k, v in ranks[0].items() if "diff" in k})
    for report in ranks:
        for name in ("text", "text_lora", "vl"):
            assert report[f"{name}_partitioned"] and report[f"{name}_max_diff"] == 0.0, name
            assert report[f"{name}_same_random_stream"] and not report[f"{name}_zero3_flag_left_on"], name
            assert report[f"checkpointing_{name}_max_rel_diff"] <= 1e-5, name
            assert report[f"checkpointing_{name}_unmoved_max_diff"] == 0.0, name
            calls = report[f"checkpointing_{name}_calls"]
            assert set(calls["plain"].values()) == {1} and set(calls["checkpointed"].values()) == {2}, calls
        assert "vision_block" in report["checkpointing_vl_calls"]["checkpointed"]
        assert report["checkpointing_text_tensors_moved"] == 38  # every tensor
        assert report["checkpointing_text_lora_tensors_moved"] == 28  # each lora_B (lora_A: gradient 0 while B = 0)
        for name in ("folder", "vl_folder"):
            assert report[f"{name}_partitioned"] and report[f"{name}_max_diff"] == 0.0, name
        assert report["bf16_zero3_dtypes"] == ["torch.bfloat16"] and report["bf16_zero3_partitioned"]
        assert report["fp16_zero3_dtypes"] == ["torch.float16"] and report["fp16_zero3_partitioned"]
        assert report["bf16_zero2_dtypes"] == ["torch.bfloat16"] and not report["bf16_zero2_partitioned"]


def vl_grads(lora, checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of the tiny Qwen2-VL model on one packed row of four image samples, and how
    often its first vision block ran."""
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER), lora=lora, gradient_checkpointing=checkpointing)
    base = model.get_base_model() if lora else model
    assert not [h for m in base.modules() for h in m._forward_hooks.values()
                if getattr(h, "__name__", "").startswith("make_inputs_require_grad")]  # reentrant's needs only
    calls = []
    base.model.visual.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    dataset = SampleDataset(ROOT / "data" / "mm" / "train.jsonl", TOKENIZER, vision=vision_spec(base, DataConfig()))
    batch = collate_packed([dataset[i] for i in range(4)])
    labels = batch.pop("labels")
    batch["position_ids"] = packed_position_ids(base, batch["input_ids"], batch["cu_seq_lens_q"],
                                                batch["image_grid_thw"])
    logits = model(**batch, use_cache=False).logits
    F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, len(calls)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_checkpointed_gradients_of_packed_image_rows_equal_plain_ones(lora):
    """One process, odb's varlen attention over a packed row: the recomputed language layers and
    vision blocks give the gradients the plain backward gives. With LoRA the frozen vision tower
    has nothing to train: no backward through it, so no recomputation either (inputs are not made
    to require grad: non-reentrant checkpoints do not need it)."""
    plain, plain_runs = vl_grads(lora, checkpointing=False)
    grads, runs = vl_grads(lora, checkpointing=True)
    assert grads.keys() == plain.keys()
    worst = max(float((grads[n] - plain[n]).abs().max() / plain[n].abs().max().clamp_min(1e-30)) for n in plain)
    print(f"VL {'LoRA' if lora else 'full'}: worst relative gradient difference {worst:.2e}; "
          f"first vision block ran {plain_runs} / {runs} times")
    assert worst <= 1e-5 and plain_runs == 1 and runs == (1 if lora else 2)
    assert sum(int(g.abs().max() > 0) for g in plain.values()) >= len(plain) // 2  # gradients that say something


def test_bench_load_reports_the_partitioned_share(tmp_path):
    """tools/bench/bench_load.py on a small model: the rank holds half the parameters after a partitioned
    build, all of them after a whole one, half after deepspeed.initialize either way."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "bench_load.py"), "--layers", "2",
                           "--hidden", "256",
                           "--intermediate", "688", "--vocab", "1024", "--heads", "4"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    whole = result["model_mb"]
    assert result["params"] == 2 * 1024 * 256 + 2 * (4 * 256 * 256 + 3 * 256 * 688 + 2 * 256) + 256
    assert result["full_load_param_mb_held_after_build_per_rank"] == [whole, whole]
    half = pytest.approx([whole / 2] * 2, abs=0.1)
    assert result["partitioned_param_mb_held_after_build_per_rank"] == half
    assert result["full_load_param_mb_held_per_rank"] == result["partitioned_param_mb_held_per_rank"] == half
    assert len(result["full_load_peak_rss_mb_per_rank"]) == len(result["partitioned_peak_rss_mb_per_rank"]) == 2
