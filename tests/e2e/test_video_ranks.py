"""Videos end to end on CPU: 2 ranks of launch/train.py under ZeRO-3 and FSDP2, where the vision
tower's parameters are gathered per call, so every rank must call it alike with or without videos.

Oracle: one process, the model's own forward (its own eager attention, its own M-RoPE from its
own ``get_rope_index`` with the videos as videos) on each sample alone; the step must move the
weights by lr x the gradient of (sum of token losses) / (label tokens)."""

import json
from collections import Counter

import pytest
import torch

from launch import ROOT, audit, deepspeed, ds_config, fsdp2, odb_config, sgd_step_errors, write_json
from odb.data.processing import SampleDataset
from odb.training.model.build import build_model, vision_spec
from odb.training.step.loss import token_loss_sum
from video_data import (
    RECORDS,
    SMALL,
    VIDEO_TOKENIZER,
    config_file,
    data_config_file,
    model_inputs,
    tokenizer_folder,
    write_records,
)

ORDER = [0, 3, 2, 4, 1]
"""The records in this order: the static shards leave a micro-batch with videos on one rank where
its peer has none (asserted below)."""
BACKENDS = {"zero3": "qwen2_5_vl", "fsdp2": "qwen3_vl"}  # Qwen2.5-VL's seconds, Qwen3-VL's group times


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_step_with_videos_on_two_ranks_equals_one_process(tmp_path, backend):
    family = BACKENDS[backend]
    data = write_records(tmp_path, [RECORDS[i] for i in ORDER])
    model_path, out, lr = config_file(tmp_path, family), tmp_path / "out", 1e4
    common = ["--model", str(model_path), "--tokenizer", str(tokenizer_folder(tmp_path)), "--data", str(data),
              "--data_config", str(data_config_file(tmp_path)),
              "--odb_config", str(odb_config(tmp_path, max_tokens=96, window=8, gas=3, sharding="static")),
              "--output_dir", str(out), "--optimizer", "sgd", "--lr", str(lr), "--warmup_ratio", "0",
              "--audit_ids", "--num_workers", "0"]
    if backend == "zero3":
        deepspeed(["--deepspeed_config", str(ds_config(tmp_path, 3, gradient_clipping=0.0)), *common])
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        after = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step1")
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        settings = {**json.loads((ROOT / "configs" / "fsdp2.json").read_text()), "gradient_clipping": 0.0}
        fsdp2(["--backend", "fsdp2", "--fsdp_config", str(write_json(tmp_path / "fsdp2.json", settings)), *common])
        dcp_to_torch_save(out / "checkpoints" / "step1" / "fsdp2", tmp_path / "consolidated.pt")
        after = torch.load(tmp_path / "consolidated.pt", weights_only=False)["model"]
    rows = audit(out, 2)
    assert [[(r["step"], r["micro"]) for r in rank] for rank in rows][0] == \
        [[(r["step"], r["micro"]) for r in rank] for rank in rows][1], "ranks ran different micro-batches"
    assert {r["step"] for rank in rows for r in rank} == {0}  # one step
    assert Counter(i for rank in rows for r in rank for i in r["ids"]) == Counter(range(5))
    with_video = {i for i, record in enumerate(ORDER) if record in (0, 1, 2)}
    has = [[bool(set(r["ids"]) & with_video) for r in rank] for rank in rows]
    print("micro-batches with videos, by rank:", has)
    assert any(a != b for a, b in zip(*has)), "no micro-batch where one rank has videos and its peer none"

    model = build_model(model_path, seed=0, vocab_size=len(VIDEO_TOKENIZER))
    model.set_attn_implementation("eager")  # the model's own attention, not odb's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = SampleDataset(data, VIDEO_TOKENIZER, SMALL, vision=vision_spec(model, SMALL, source=model_path))
    total, label_tokens = 0.0, 0
    for i in range(5):
        sample = dataset[i]
        logits = model(**model_inputs(sample), use_cache=False).logits
        total = total + token_loss_sum(logits, sample["labels"][None])
        label_tokens += int((sample["labels"][1:] != -100).sum())
    (total / label_tokens).backward()
    moved, worst, still = sgd_step_errors(model, before, after, lr)
    assert any(n.startswith("model.visual") for n in moved)  # the vision tower trained
    print(f"{backend} {family} with videos: {len(moved)} tensors moved, worst relative error {worst:.2e}; largest "
          f"change of a tensor without gradient {still:.2e}")
    assert worst <= 1e-5 and still == 0.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_emitted"] == 5 and not summary.get("skipped")
