"""check-model (odb/cli/check_model.py, odb/training/check_model.py) on tiny model folders.

The check compares odb's path with the model's own code; these tests show that it passes where odb
is exact, refuses what odb refuses (naming why), and fails where packing would leak: an LFM2 with
short convolutions, its refusal switched off, gives packed logits far from each sample alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_images import CONFIGS as IMAGE_CONFIGS
from test_images import PROCESSORS
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from conftest import ROOT, bundled_tokenizer
from odb.cli.check_model import main
from odb.training import check_model as model_check

SMALL = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 1, "initializer_range": 0.1}
FAMILIES = {
    "llama": {"model_type": "llama"},
    "lfm2": {"model_type": "lfm2", "layer_types": ["conv", "full_attention"], "conv_L_cache": 3},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "router_aux_loss_coef": 0.1},
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                "router_aux_loss_coef": 0.1},
    "qwen3_next": {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"],
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16},
}


def folder(tmp_path, family: str):
    """A tiny random model of ``family`` saved with the bundled tokenizer."""
    out = tmp_path / family
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**SMALL, **FAMILIES[family]}))
    model.save_pretrained(out)
    bundled_tokenizer().save_pretrained(out)
    return out


def test_a_dense_model_passes_with_tight_differences(tmp_path, capsys):
    path = folder(tmp_path, "llama")
    assert main([str(path), "--samples", "6", "--max_tokens", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(report)
    assert report["ok"] and report["refused"] is None and report["aux_loss_included"] is None
    assert report["samples"] == 6 and report["model_type"] == "llama"
    assert report["max_logit_diff"] < 1e-4 and report["loss_rel_diff"] < 1e-5 and report["grad_rel_diff"] < 1e-4
    assert report["label_preview"], "the first sample's label runs are shown"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_vl_model_passes_with_its_own_image_processor(tmp_path, capsys, family):
    """Qwen2-VL and Qwen3-VL folders with their families' public processor configs, on the bundled
    image chats: M-RoPE positions, vision towers and images through odb's packed rows."""
    path = tmp_path / family
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.for_model(**IMAGE_CONFIGS[family])).save_pretrained(path)
    bundled_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_bytes((PROCESSORS / f"{family}.json").read_bytes())
    data_config = tmp_path / "data.json"
    data_config.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 50176}))
    argv = [str(path), "--data", str(ROOT / "data" / "mm" / "train.jsonl"), "--data_config", str(data_config),
            "--samples", "5", "--max_tokens", "1024", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(report)
    assert report["ok"] and report["samples"] == 5 and report["image_processor_max_diff"] == 0.0
    assert report["max_logit_diff"] < 1e-4 and report["grad_rel_diff"] < 1e-4


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_model_that_takes_videos_passes_on_video_records(tmp_path, capsys, family):
    """Video files, a frame folder, an image with two videos, an image and text through odb's packed
    rows against the model's own forward with its videos as videos. transformers' video processor
    needs torchvision, which this machine cannot install beside its torch: the report says so."""
    from odb.data.images import vision_spec_for
    from video_data import SMALL, VIDEO_TOKENIZER, config_dict, data_config_file, write_records

    path = tmp_path / family
    torch.manual_seed(0)
    config = AutoConfig.for_model(**config_dict(family))
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    VIDEO_TOKENIZER.save_pretrained(path)
    vision = vision_spec_for(config)
    vision.build().save_pretrained(path)  # the family's image processor, the tower's geometry
    # and its video processor, as published Qwen2-VL/Qwen3-VL folders carry one
    (path / "video_preprocessor_config.json").write_text(json.dumps(vision.video.processor_config()))
    argv = [str(path), "--data", str(write_records(tmp_path)), "--data_config", str(data_config_file(tmp_path, SMALL)),
            "--samples", "5", "--max_tokens", "1024", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(report)
    assert report["ok"] and report["samples"] == 5 and not report["skipped"]
    assert report["max_logit_diff"] < 1e-4 and report["loss_rel_diff"] < 1e-5 and report["grad_rel_diff"] < 1e-4
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():  # the folder's own video processor, on the same frames
        assert report["video_processor_max_diff"] == 0.0
    else:
        assert report["video_processor_max_diff"] is None and "torchvision" in report["notes"][0]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_an_moe_model_passes_with_its_router_loss_included(tmp_path, capsys, family):
    """Qwen3-MoE, and gpt-oss with its attention sinks and sliding windows: the model's own loss
    with output_router_logits (router loss at coefficient 0.1) is what odb trains."""
    assert main([str(folder(tmp_path, family)), "--samples", "6", "--max_tokens", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(report)
    assert report["ok"] and report["aux_loss_included"] is True
    assert report["loss_rel_diff"] < 1e-5 and report["grad_rel_diff"] < 1e-4


@pytest.mark.parametrize("family, layer", [("lfm2", "Lfm2ShortConv"), ("qwen3_next", "Qwen3NextGatedDeltaNet")])
def test_a_model_with_non_attention_token_mixers_is_refused_naming_its_layers(tmp_path, capsys, family, layer):
    path = folder(tmp_path, family)
    assert main([str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not report["ok"] and layer in report["refused"], report["refused"]


def test_the_check_fails_where_packing_would_leak(tmp_path, monkeypatch):
    """With the refusal switched off, LFM2's convolution carries the previous sample into the next:
    the packed logits are far from each sample alone, and the check says so."""
    monkeypatch.setattr(model_check, "packing_refusal", lambda model: None)
    report = model_check.check_model(folder(tmp_path, "lfm2"), data=ROOT / "data" / "chat.jsonl", num_samples=4,
                                     max_tokens=2048)
    print(report.max_logit_diff, report.problems)
    assert not report.ok and report.max_logit_diff > 1e-2
    assert any("max_logit_diff" in problem for problem in report.problems)
