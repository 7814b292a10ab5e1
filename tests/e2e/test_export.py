"""Hugging Face export: real 2-rank runs keep their final checkpoint, odb export (or
export_checkpoint) writes a folder, and transformers loads it with its default attention.

The oracle is the checkpoint itself, read back without odb's export code: DeepSpeed's
``zero_to_fp32`` (ZeRO 1-3) or the module states (ZeRO-0) loaded into a model built from the config
(transformers' default attention), or for LoRA into a PEFT model built on it (not merged).
``save_hf`` inside a live ZeRO-3 run is checked by tests/e2e/save_hf_worker.py against the
engine's own forward.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import bundled_tokenizer
from launch import ROOT, deepspeed, ds_config, fsdp2, odb_config, write_json
from odb.data.images import ImageProcessor, VisionSpec
from odb.data.processing import SampleDataset
from odb.training.export import export_checkpoint, find_checkpoint

TOKENIZER = bundled_tokenizer()
TINY = ROOT / "configs" / "tiny_model.json"
TINY_VL = ROOT / "configs" / "tiny_vl_model.json"
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())
EXPORT = ["-m", "odb.cli", "export"]
WORKER = Path(__file__).resolve().parent / "save_hf_worker.py"


def train(tmp_path: Path, stage: int, *, lora: bool = False) -> Path:
    """A 2-rank run on 24 samples (several steps); returns its OUTPUT_DIR/checkpoints."""
    out = tmp_path / "run"
    deepspeed(["--deepspeed_config", str(ds_config(tmp_path, stage)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)),
               "--max_samples", "24", "--warmup_ratio", "0", "--num_workers", "0", "--output_dir", str(out)]
              + (["--lora"] if lora else []))
    return out / "checkpoints"


def checkpoint_weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    """The final checkpoint's weights, read with DeepSpeed's own tools."""
    tag = (checkpoints / "latest").read_text().strip()
    if (checkpoints / tag / "mp_rank_00_model_states.pt").is_file():  # ZeRO-0
        return torch.load(checkpoints / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=tag)


def fresh_model(config_path: Path = TINY, *, seed: int = 0):
    """A random-init model with transformers' default attention (odb's build_model's init)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.for_model(**json.loads(config_path.read_text()))
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) else AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(config).eval()


def held_rows() -> list[torch.Tensor]:
    dataset = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, max_samples=30)
    return [dataset[i]["input_ids"][None] for i in (25, 29)]  # samples the run did not train on


@torch.no_grad()
def max_logit_diff(a, b, rows: list[torch.Tensor]) -> float:
    return max(float((a(input_ids=r).logits - b(input_ids=r).logits).abs().max()) for r in rows)


def check_folder(out: Path) -> None:
    """Config: use_cache back on, no odb attention; the tokenizer is the training tokenizer."""
    from transformers import AutoTokenizer

    text = (out / "config.json").read_text()
    assert json.loads(text)["use_cache"] is True and "odb_varlen" not in text and "attn_implementation" not in text
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.get_vocab() == TOKENIZER.get_vocab()
    assert tokenizer.chat_template == TOKENIZER.chat_template and tokenizer.pad_token == TOKENIZER.pad_token


def logits_without_odb(out: Path, rows: list[torch.Tensor], tmp_path: Path) -> list[torch.Tensor]:
    """The exported model's logits in a fresh process that imports transformers but not odb."""
    torch.save(rows, tmp_path / "rows.pt")
    script = ("import sys, torch\n"
              "from transformers import AutoModelForCausalLM\n"
              f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
              "assert m.config._attn_implementation == 'sdpa', m.config._attn_implementation\n"
              "assert not any(name.startswith('odb') for name in sys.modules)\n"
              f"rows = torch.load({str(tmp_path / 'rows.pt')!r})\n"
              "with torch.no_grad():\n"
              f"    torch.save([m(input_ids=r).logits for r in rows], {str(tmp_path / 'logits.pt')!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt")


@pytest.mark.parametrize("stage", [3, 0])
def test_full_fine_tuning_exports_the_checkpoint_weights(tmp_path, stage):
    from transformers import AutoModelForCausalLM

    checkpoints = train(tmp_path, stage)
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, *EXPORT, str(checkpoints), str(out)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)  # elsewhere than the repo: paths are absolute
    assert proc.returncode == 0 and f"wrote the model to {out}" in proc.stdout, proc.stderr[-3000:]
    check_folder(out)
    weights = checkpoint_weights(checkpoints)
    init = fresh_model().state_dict()
    assert max(float((weights[k] - init[k]).abs().max()) for k in init) > 1e-3  # the run moved the weights
    oracle = fresh_model()
    oracle.load_state_dict(weights)
    rows = held_rows()
    exported = logits_without_odb(out, rows, tmp_path)
    with torch.no_grad():
        diff = max(float((oracle(input_ids=r).logits - e).abs().max()) for r, e in zip(rows, exported))
    print(f"ZeRO-{stage}: max |logits(export) - logits(checkpoint)| = {diff:.3g}")
    assert diff <= 1e-5
    # --dtype: the same weights, rounded once to bf16
    half = export_checkpoint(checkpoints, tmp_path / "bf16", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(str(half))
    assert model.dtype == torch.bfloat16 and json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(torch.equal(p, weights[n].to(torch.bfloat16)) for n, p in model.state_dict().items())


def test_lora_exports_merged_and_as_adapter(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    checkpoints = train(tmp_path, 3, lora=True)
    weights = checkpoint_weights(checkpoints)
    assert max(float(v.abs().max()) for k, v in weights.items() if "lora_B" in k) > 0  # the adapter trained
    oracle = get_peft_model(fresh_model(), LoraConfig(task_type="CAUSAL_LM", **LORA)).eval()
    oracle.load_state_dict(weights)  # base + adapter, unmerged
    base = fresh_model()
    base.load_state_dict({k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
                          for k, v in weights.items() if "lora_" not in k})
    rows = held_rows()

    merged = export_checkpoint(checkpoints, tmp_path / "merged")
    check_folder(merged)
    assert not (merged / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert not any("lora" in name for name in model.state_dict())
    merged_diff = max_logit_diff(model, oracle, rows)

    adapter = export_checkpoint(checkpoints, tmp_path / "adapter", adapter_only=True)
    assert not (adapter / "model.safetensors").exists()
    with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()
    adapter_diff = max_logit_diff(with_adapter, oracle, rows)
    with with_adapter.disable_adapter():  # the base alone: what the adapter changes
        base_diff = max_logit_diff(with_adapter, oracle, rows)
    print(f"LoRA: merged {merged_diff:.3g}, adapter {adapter_diff:.3g}, the base alone {base_diff:.3g}")
    assert merged_diff <= 1e-5 and adapter_diff <= 1e-5 and base_diff > 1e-3


HEAD_CASES = {  # backend, how LoRA reaches the LM head of the tied-embedding tiny model
    "deepspeed-target_modules": ("deepspeed", {"target_modules": [*LORA["target_modules"], "lm_head"]}),
    "deepspeed-modules_to_save": ("deepspeed", {"modules_to_save": ["lm_head"]}),
    "fsdp2-target_modules": ("fsdp2", {"target_modules": [*LORA["target_modules"], "lm_head"]}),
}


@pytest.mark.parametrize("case", list(HEAD_CASES))
def test_lora_on_the_head_of_a_tied_embedding_model_exports_merged(tmp_path, case):
    """LoRA on ``lm_head`` while it shares its weight with the input embeddings (the tiny model ties
    them): training changes the head only, so the merged model has a head of its own
    (``tie_word_embeddings`` false) and the base's input embeddings. Both doors: ``--save_hf`` at the
    end of the run, and odb export on its final checkpoint. The oracle: a PEFT model on a
    fresh base, given the checkpoint's weights, unmerged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    backend, settings = HEAD_CASES[case]
    lora = {**LORA, **settings}
    out = tmp_path / "run"
    common = ["--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)), "--max_samples", "24",
              "--warmup_ratio", "0", "--num_workers", "0", "--lr", "1e-2", "--output_dir", str(out),
              "--lora", str(write_json(tmp_path / "lora.json", lora)), "--save_hf"]
    if backend == "fsdp2":
        fsdp2(["--backend", "fsdp2", *common])
    else:
        deepspeed(["--deepspeed_config", str(ds_config(tmp_path, 2)), *common])
    oracle = get_peft_model(fresh_model(), LoraConfig(task_type="CAUSAL_LM", **lora)).eval()
    if backend == "fsdp2":  # the checkpoint holds the trained weights; the frozen ones are the seeded init's
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        tag = (out / "checkpoints" / "latest").read_text().strip()
        dcp_to_torch_save(out / "checkpoints" / tag / "fsdp2", tmp_path / "trained.pt")
        weights = torch.load(tmp_path / "trained.pt", weights_only=False)["model"]
        missing = oracle.load_state_dict(weights, strict=False).missing_keys
        assert not [k for k in weights if k not in oracle.state_dict()] and all("lora_" not in k for k in missing)
    else:
        oracle.load_state_dict(checkpoint_weights(out / "checkpoints"))
    trained = [k for k in oracle.state_dict() if "lm_head" in k and ("lora_B" in k or "modules_to_save" in k)]
    base_embeddings = fresh_model().get_input_embeddings().weight
    offline = tmp_path / "offline"
    proc = subprocess.run([sys.executable, *EXPORT, str(out / "checkpoints"), str(offline)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = held_rows()
    with torch.no_grad():
        expected = [oracle(input_ids=r).logits for r in rows]
        head = oracle.get_base_model().lm_head  # its effective weight: the head applied to the unit vectors
        head_delta = float((head(torch.eye(base_embeddings.shape[1])).T - base_embeddings).abs().max())
    assert trained and head_delta > 1e-4  # the run trained the head
    for folder in (out / "hf", offline):
        check_folder(folder)
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        assert model.config.tie_word_embeddings is False and not any("lora" in k for k in model.state_dict())
        assert torch.equal(model.get_input_embeddings().weight, base_embeddings)  # the head's delta is not in them
        exported = logits_without_odb(folder, rows, tmp_path)
        diff = max(float((e - x).abs().max()) for e, x in zip(exported, expected))
        print(f"{case}: {folder.name}: max |logits(export) - logits(PEFT model)| = {diff:.3g}, "
              f"the head's trained delta {head_delta:.3g}")
        assert diff <= 1e-5


def test_save_hf_in_a_live_zero3_run(tmp_path):
    """2 ranks: every parameter partitioned, save_hf merged and adapter-only, training goes on."""
    deepspeed([str(tmp_path)], timeout=300, script=WORKER)
    report = json.loads((tmp_path / "report.json").read_text())
    print("save_hf:", {k: v for k, v in report.items() if k.endswith("diff")})
    for name in ("full", "lora"):
        assert report[f"{name}_partitioned"]
        assert report[f"{name}_unchanged_max_diff"] == 0.0  # save_hf left the live model alone
        assert report[f"{name}_trained_on_max_diff"] > 1e-3  # and the next step trained it
    for folder in ("full", "lora", "lora_adapter"):
        assert report[f"{folder}_written_on_rank0"] and report[f"{folder}_written_on_rank1"]
        assert report[f"{folder}_max_diff"] <= 1e-5, folder
    check_folder(tmp_path / "full")


def test_vision_language_export_keeps_the_image_processor(tmp_path):
    """A ZeRO-0-style checkpoint written here (no launch): the model, and the image processor the run
    used (its pixel range, not the default), load with transformers' auto classes; the video
    processor's settings are the run's."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = fresh_model(TINY_VL, seed=3)
    tag = tmp_path / "checkpoints" / "step5"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
    pixels = {"min_pixels": 28 * 28, "max_pixels": 112 * 112}
    video = {"video_fps": 1.5, "video_max_frames": 64, "video_max_pixels": 200000, "video_max_tokens": 512}
    run = {"model": {"path": str(TINY_VL), "tokenizer": str(ROOT / "data" / "tokenizer"), "lora": None},
           "data": {"processing": {**pixels, **video}}, "optimization": {"deepspeed": {"bf16": {"enabled": False}}}}
    (tag / "run_config.json").write_text(json.dumps(run))
    (tag.parent / "latest").write_text("step5")
    out = export_checkpoint(tag.parent, tmp_path / "hf")
    check_folder(out)
    assert json.loads((out / "config.json").read_text())["text_config"]["use_cache"] is True
    # the video processor as the run had it: odb reads it back the same (transformers' AutoVideoProcessor
    # reads it the same too, where torchvision is installed: tools/check/check_video_processor.py --folder)
    from odb.data.videos import video_spec_for

    saved = json.loads((out / "video_preprocessor_config.json").read_text())
    assert saved["video_processor_type"] == "Qwen2VLVideoProcessor" and saved["fps"] == 1.5
    assert saved["cap_pixels_per_frame"] is True and saved["max_video_tokens"] == 512
    assert video_spec_for(model.config, out) == video_spec_for(model.config, None, fps=1.5, max_frames=64,
                                                               max_pixels=200000, max_video_tokens=512,
                                                               cap_pixels_per_frame=True)
    loaded = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    processor = AutoImageProcessor.from_pretrained(str(out))
    image = Image.new("RGB", (300, 200), (120, 30, 200))
    got = processor(images=[image], return_tensors="pt")
    spec = model.config.vision_config
    pixel_values, grid = ImageProcessor(VisionSpec(**pixels, patch_size=spec.patch_size, merge_size=2,
                                                   temporal_patch_size=spec.temporal_patch_size))([image])
    assert torch.equal(got["pixel_values"], pixel_values) and torch.equal(got["image_grid_thw"], grid)
    tokens = int(grid.prod()) // 4
    ids = torch.tensor([[1, 20, 30, 5] + [7] * tokens + [6, 40, 50]])
    batch = {"input_ids": ids, "pixel_values": pixel_values, "image_grid_thw": grid,
             "mm_token_type_ids": (ids == 7).int()}
    with torch.no_grad():
        diff = float((loaded(**batch).logits - model(**batch).logits).abs().max())
    assert diff == 0.0


def test_a_wrong_folder_names_the_fix(tmp_path):
    fix = "pass OUTPUT_DIR/checkpoints/<tag>"
    with pytest.raises(FileNotFoundError, match=f"is not a folder; {fix}"):
        find_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=f"is not a checkpoint .*; {fix}"):
        find_checkpoint(tmp_path)
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="holds DeepSpeed files but no run_config.json"):
        find_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step9")
    with pytest.raises(FileNotFoundError, match="names step9, but .* has no run_config.json"):
        find_checkpoint(tmp_path)
    (tmp_path / "step9").mkdir()
    (tmp_path / "step9" / "run_config.json").write_text("{}")
    assert find_checkpoint(tmp_path) == find_checkpoint(tmp_path / "step9") == tmp_path / "step9"
    output_dir = tmp_path / "out"
    (output_dir / "checkpoints" / "step2").mkdir(parents=True)
    (output_dir / "checkpoints" / "step2" / "run_config.json").write_text("{}")
    (output_dir / "checkpoints" / "latest").write_text("step2\n")
    assert find_checkpoint(output_dir) == output_dir / "checkpoints" / "step2"  # OUTPUT_DIR works too
    proc = subprocess.run([sys.executable, *EXPORT, str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"odb export: checkpoint {tmp_path / 'nope'} is not a folder" in proc.stderr
