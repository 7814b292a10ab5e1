"""The model's own image processor (odb.data.images, odb.training.model.build.vision_spec, the export).

Tiny random-init Qwen2-VL, Qwen2.5-VL and Qwen3-VL folders, each with its family's public
``preprocessor_config.json`` (tests/fixtures/processors): odb's ``pixel_values`` and
``image_grid_thw`` equal what the folder's own processor (``AutoImageProcessor.from_pretrained``)
returns on the same images, and the visual tokens of odb's samples are the ones its grid makes.
The oracle is transformers' own processor, never odb's spec.
"""

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.utils import is_torchvision_available

from conftest import ROOT, bundled_tokenizer
from odb.data.images import ImageProcessor
from odb.data.processing import DataConfig, SampleDataset
from odb.training.export import export_checkpoint, write_hf
from odb.training.model.build import build_model, vision_spec

TOKENIZER = bundled_tokenizer()
PROCESSORS = ROOT / "tests" / "fixtures" / "processors"
IDS = {"image_token_id": 7, "video_token_id": 7, "vision_start_token_id": 5, "vision_end_token_id": 6}  # bundled's
TEXT = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "eos_token_id": 1}
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
VISION = {"depth": 1, "hidden_size": 64, "num_heads": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
          "in_channels": 3}
CONFIGS = {  # the families' own vision geometry: 14-pixel patches, and Qwen3-VL's 16
    "qwen2_vl": {"model_type": "qwen2_vl", **IDS, "text_config": {"model_type": "qwen2_vl_text",
                                                                   "rope_parameters": ROPE, **TEXT},
                 "vision_config": {"model_type": "qwen2_vl", "embed_dim": 64, "mlp_ratio": 2, "patch_size": 14,
                                   **VISION}},
    "qwen2_5_vl": {"model_type": "qwen2_5_vl", **IDS, "text_config": {"model_type": "qwen2_5_vl_text",
                                                                       "rope_parameters": ROPE, **TEXT},
                   "vision_config": {"model_type": "qwen2_5_vl", "intermediate_size": 128, "out_hidden_size": 64,
                                     "window_size": 56, "fullatt_block_indexes": [0], "patch_size": 14, **VISION}},
    "qwen3_vl": {"model_type": "qwen3_vl", **IDS,
                 "text_config": {"model_type": "qwen3_vl_text", "rope_parameters": {**ROPE, "mrope_interleaved": True},
                                 **TEXT},
                 "vision_config": {"model_type": "qwen3_vl", "intermediate_size": 128, "out_hidden_size": 64,
                                   "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "patch_size": 16,
                                   **VISION}},
}
SIZES = [(700, 500), (90, 60), (33, 250), (20, 20)]  # over 448 x 448 pixels, small, narrow, under min_pixels


def noise_images(folder):
    """Random-noise RGB images (so mean and std matter), saved as PNG and returned as PIL images."""
    rng = np.random.default_rng(0)
    images = []
    for i, (width, height) in enumerate(SIZES):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        image.save(folder / f"{i}.png")
        images.append(image)
    return images


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per family: a model folder (config, weights, the public preprocessor_config.json)."""
    out = {}
    for family, config in CONFIGS.items():
        folder = tmp_path_factory.mktemp(family)
        (folder / "model.json").write_text(json.dumps(config))
        build_model(folder / "model.json", seed=0, vocab_size=len(TOKENIZER)).save_pretrained(folder / "hf")
        (folder / "hf" / "preprocessor_config.json").write_bytes((PROCESSORS / f"{family}.json").read_bytes())
        out[family] = folder
    return out


def processed(processor, images):
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_pixel_values_equal_the_folder_s_own_processor_and_samples_hold_its_visual_tokens(tmp_path, folders, family):
    folder = folders[family] / "hf"
    images = noise_images(tmp_path)
    own = AutoImageProcessor.from_pretrained(str(folder))
    model = build_model(folder, seed=0, vocab_size=len(TOKENIZER))
    spec = vision_spec(model, DataConfig())  # the model's own pixel bounds
    pixel_values, grids = ImageProcessor(pickle.loads(pickle.dumps(spec)))(images)  # (as a DataLoader worker gets it)
    want_values, want_grids = processed(own, images)
    assert torch.equal(grids, want_grids) and torch.equal(pixel_values, want_values)
    assert spec.patch_size == CONFIGS[family]["vision_config"]["patch_size"]
    records = [{"images": [f"{i}.png"], "messages": [{"role": "user", "content": "<image>What is it?"},
                                                     {"role": "assistant", "content": "Noise."}]}
               for i in range(len(images))]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = SampleDataset(tmp_path / "d.jsonl", TOKENIZER, vision=spec)
    for i, image in enumerate(images):
        sample = dataset[i]
        values, grid = processed(own, [image])
        assert torch.equal(sample["pixel_values"], values) and torch.equal(sample["image_grid_thw"], grid)
        assert int((sample["input_ids"] == IDS["image_token_id"]).sum()) == int(grid.prod()) // 4  # merged 2 x 2
        assert sample["patches"] == int(grid.prod())


def test_the_data_config_overrides_only_the_pixel_bounds(tmp_path, folders):
    folder = folders["qwen3_vl"] / "hf"
    images = noise_images(tmp_path)
    bounds = {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
    own = AutoImageProcessor.from_pretrained(str(folder), size=bounds)
    model = build_model(folder, seed=0, vocab_size=len(TOKENIZER))
    spec = vision_spec(model, DataConfig(min_pixels=32 * 32, max_pixels=128 * 128))
    got = ImageProcessor(spec)(images)
    want = processed(own, images)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    built = spec.build()
    assert tuple(built.image_mean) == tuple(built.image_std) == (0.5, 0.5, 0.5)  # Qwen3-VL's, not CLIP's
    assert (spec.min_pixels, spec.max_pixels, spec.patch_size) == (32 * 32, 128 * 128, 16)
    with pytest.raises(ValueError, match=r"need min_pixels <= max_pixels, got 65536 > 4096 .*None: the model's own"):
        vision_spec(model, DataConfig(max_pixels=64 * 64))  # under Qwen3-VL's own min_pixels


def family_default(**settings):
    """The family's image processor class (the backend ``AutoImageProcessor`` would pick here)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLImageProcessorPil

    return (Qwen2VLImageProcessor if is_torchvision_available() else Qwen2VLImageProcessorPil)(**settings)


@pytest.mark.parametrize("family, settings", [("qwen2_vl", {}), ("qwen3_vl", {"patch_size": 16})])
def test_a_config_json_gets_the_family_processor_with_its_defaults_and_the_tower_s_geometry(tmp_path, family,
                                                                                          settings):
    images = noise_images(tmp_path)
    path = ROOT / "configs" / "tiny_vl_model.json"  # the bundled demo's (Qwen2-VL)
    if family != "qwen2_vl":
        path = tmp_path / "model.json"
        path.write_text(json.dumps(CONFIGS[family]))
    model = build_model(path, seed=0, vocab_size=len(TOKENIZER))
    for data_config, bounds in ((DataConfig(), {}),
                                (DataConfig(min_pixels=3136, max_pixels=200704),  # configs/data.json's
                                 {"min_pixels": 3136, "max_pixels": 200704})):
        got = ImageProcessor(vision_spec(model, data_config))(images)
        want = processed(family_default(**settings, **bounds), images)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_a_processor_that_does_not_fit_the_vision_tower_names_the_fix(tmp_path, folders):
    from transformers import AutoConfig

    from odb.data.images import vision_spec_for

    (tmp_path / "preprocessor_config.json").write_bytes((PROCESSORS / "qwen2_vl.json").read_bytes())  # 14 pixels
    config = AutoConfig.for_model(**CONFIGS["qwen3_vl"])  # a tower of 16-pixel patches
    with pytest.raises(ValueError, match=r"has patch_size 14 but the model's vision tower has patch_size 16: fix the "
                                         r"model's preprocessor_config.json"):
        vision_spec_for(config, tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()  # none at all: the family's defaults, with a warning
    with pytest.warns(UserWarning, match="has no preprocessor_config.json.*copy the base model's"):
        spec = vision_spec_for(config, tmp_path)
    assert spec.patch_size == 16


def test_the_export_writes_the_processor_the_run_used(tmp_path, folders):
    """save_hf's writer and the offline export of a checkpoint: AutoImageProcessor on the exported
    folder gives the pixel values the run computed (the model's statistics, the run's bounds)."""
    folder = folders["qwen3_vl"] / "hf"
    images = noise_images(tmp_path)
    model = build_model(folder, seed=0, vocab_size=len(TOKENIZER))
    pixels = {"min_pixels": 32 * 32, "max_pixels": 96 * 96}
    spec = vision_spec(model, DataConfig(**pixels))
    run_values = ImageProcessor(spec)(images)
    out = write_hf(model.state_dict(), model_path=folder, lora=None, tokenizer=ROOT / "data" / "tokenizer",
                   out=tmp_path / "hf", vision=spec)
    assert torch.equal(processed(AutoImageProcessor.from_pretrained(str(out)), images)[0], run_values[0])
    tag = tmp_path / "run" / "checkpoints" / "step1"  # a ZeRO-0 checkpoint, as the e2e export tests write one
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
    (tag / "run_config.json").write_text(json.dumps({
        "model": {"path": str(folder), "tokenizer": str(ROOT / "data" / "tokenizer"), "lora": None},
        "data": {"processing": pixels}, "optimization": {"deepspeed": {"bf16": {"enabled": False}}}}))
    exported = export_checkpoint(tag, tmp_path / "offline")
    offline = AutoImageProcessor.from_pretrained(str(exported))
    assert torch.equal(processed(offline, images)[0], run_values[0]) and tuple(offline.image_mean) == (0.5,) * 3
