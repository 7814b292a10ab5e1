"""Video test data: the bundled VL demo's tokenizer (data/vl_tokenizer: the bundled tokenizer plus
``<|video_pad|>``, id 1024), tiny Qwen-VL configs that take videos, MPEG-4 clips and frame folders
written in the test, and records that use them."""

import json
from pathlib import Path

import av
import numpy as np
from PIL import Image

from conftest import ROOT
from odb.data.processing import DataConfig
from odb.training.model.build import load_tokenizer

VIDEO_TOKENIZER = load_tokenizer(ROOT / "data" / "vl_tokenizer")
VIDEO_ID = VIDEO_TOKENIZER.convert_tokens_to_ids("<|video_pad|>")
IMAGE_ID = 7
IDS = {"image_token_id": IMAGE_ID, "video_token_id": VIDEO_ID, "vision_start_token_id": 5, "vision_end_token_id": 6}
TEXT = {"vocab_size": len(VIDEO_TOKENIZER), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
VISION = {"depth": 1, "hidden_size": 64, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
          "temporal_patch_size": 2, "in_channels": 3}
FAMILIES = {
    "qwen2_vl": ({"model_type": "qwen2_vl_text"}, {"model_type": "qwen2_vl", "embed_dim": 64, "mlp_ratio": 2}),
    "qwen2_5_vl": ({"model_type": "qwen2_5_vl_text"}, {"model_type": "qwen2_5_vl", "intermediate_size": 128,
                                                       "out_hidden_size": 64, "window_size": 56,
                                                       "fullatt_block_indexes": [0]}),
    "qwen3_vl": ({"model_type": "qwen3_vl_text"}, {"model_type": "qwen3_vl", "intermediate_size": 128,
                                                   "out_hidden_size": 64, "num_position_embeddings": 64,
                                                   "deepstack_visual_indexes": [0]}),
}
SMALL = DataConfig(video_fps=2.0, video_min_pixels=4 * 28 * 28, video_max_pixels=8 * 28 * 28, min_pixels=4 * 28 * 28,
                   max_pixels=8 * 28 * 28)
"""Small frames and images (4-8 visual tokens each): fast on the CPU."""


def config_dict(family: str) -> dict:
    text, vision = FAMILIES[family]
    return {"model_type": family, "text_config": {**TEXT, **text}, "vision_config": {**VISION, **vision}, **IDS}


def config_file(folder: Path, family: str) -> Path:
    path = folder / f"{family}.json"
    path.write_text(json.dumps(config_dict(family)))
    return path


def tokenizer_folder(folder: Path) -> Path:
    VIDEO_TOKENIZER.save_pretrained(folder / "tokenizer")
    return folder / "tokenizer"


def data_config_file(folder: Path, config: DataConfig = SMALL) -> Path:
    keys = ("video_fps", "video_min_pixels", "video_max_pixels", "min_pixels", "max_pixels", "image_folder")
    path = folder / "data_config.json"
    path.write_text(json.dumps({k: getattr(config, k) for k in keys if getattr(config, k) is not None}))
    return path


def write_clip(path: Path, frames: int = 12, height: int = 60, width: int = 90, fps: int = 6) -> list[np.ndarray]:
    """An MPEG-4 clip of random frames; returns the frames as decoded back."""
    rng = np.random.default_rng(frames * 1000 + height)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def media(folder: Path) -> None:
    """clip.mp4 (12 frames, 2 s), long.mp4 (30 frames, 3 s), frames/ (4 frame images), red.png."""
    write_clip(folder / "clip.mp4", frames=12)
    write_clip(folder / "long.mp4", frames=30, height=40, width=70, fps=10)
    (folder / "frames").mkdir(exist_ok=True)
    rng = np.random.default_rng(3)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(folder / "frames" / f"{i}.jpg")
    Image.new("RGB", (56, 84), (200, 10, 10)).save(folder / "red.png")


def video_part(path=None, **extra) -> dict:
    return {"type": "video", **({"video": path} if path is not None else {}), **extra}


RECORDS = [
    {"messages": [{"role": "user", "content": [video_part("clip.mp4"), {"type": "text", "text": "What moves?"}]},
                  {"role": "assistant", "content": "A square."}]},
    {"conversations": [{"from": "human", "value": "<video>\nDescribe."}, {"from": "gpt", "value": "Noise."}],
     "video": "frames"},
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"}, video_part(),
                                               {"type": "text", "text": "Same?"}, video_part()]},
                  {"role": "assistant", "content": "No."}], "videos": ["long.mp4", ["frames/0.jpg", "frames/1.jpg"]]},
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                               {"type": "text", "text": "And this one?"}]},
                  {"role": "assistant", "content": "Red, all of it."}]},
    {"messages": [{"role": "user", "content": "Say two words."}, {"role": "assistant", "content": "Two words."}]},
]
"""A video file; a frame folder (LLaVA style); an image and two videos; an image; text."""


def write_records(folder: Path, rows=RECORDS) -> Path:
    media(folder)
    path = folder / "videos.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def model_inputs(sample: dict) -> dict:
    """A processed sample's inputs to the model's own forward, alone (it makes its own M-RoPE)."""
    ids = sample["input_ids"][None]
    inputs = {k: sample[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                     "second_per_grid_ts") if k in sample}
    return {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE_ID).long() + 2 * (ids == VIDEO_ID).long(), **inputs}
