"""Videos in the data: odb/data/videos.py against transformers' own video processing code, and
video records through SampleDataset into the model's own forward.

transformers' Qwen-VL video processors import torchvision, which cannot be installed beside this
machine's torch; their functions (frame sampling, smart_resize, patchify, Qwen3-VL's timestamps)
and class defaults are read here from transformers' installed source with ``ast`` and run on their
own. The resize and normalization against the whole processor: tools/check/check_video_processor.py
(docs/training.md#videos)."""

import ast
import copy
import importlib.util
import json
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText

from conftest import bundled_tokenizer
from launch import ROOT
from odb.data.feed import DataError, SampleFeed
from odb.data.processing import DataConfig, SampleDataset, sample_sizes
from odb.data.video_decode import read_video
from odb.data.videos import VIDEO_FAMILIES, Clip, VideoSpec, process_video
from odb.training.model.build import build_model, vision_spec
from video_data import (
    FAMILIES,
    SMALL,
    VIDEO_ID,
    VIDEO_TOKENIZER,
    config_dict,
    media,
    model_inputs,
    video_part,
    write_clip,
    write_records,
)

TRANSFORMERS = Path(importlib.util.find_spec("transformers").origin).parent
QWEN2 = TRANSFORMERS / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
QWEN3 = TRANSFORMERS / "models" / "qwen3_vl" / "video_processing_qwen3_vl.py"


def their(path: Path, name: str, cls: str | None = None):
    """transformers' function ``name`` (a method of ``cls``), compiled alone from its source."""
    tree = ast.parse(path.read_text())
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    node = copy.deepcopy(next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name))
    for sub in ast.walk(node):  # annotations name classes this namespace does not import
        if isinstance(sub, ast.arg):
            sub.annotation = None
        if isinstance(sub, ast.FunctionDef):
            sub.returns = None
    namespace = {"math": math, "np": np, "torch": torch, "logger": SimpleNamespace(warning=print)}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def their_defaults(path: Path, cls: str) -> dict:
    from transformers import image_utils

    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = {}
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "", "eval"), vars(image_utils))
            except NameError:
                pass
    return out


@pytest.mark.parametrize("family, path, cls", [("qwen2", QWEN2, "Qwen2VLVideoProcessor"),
                                               ("qwen3", QWEN3, "Qwen3VLVideoProcessor")])
def test_family_defaults_are_transformers_own(family, path, cls):
    theirs = their_defaults(path, cls)
    ours = VIDEO_FAMILIES[family]
    assert (ours["min_pixels"], ours["max_pixels"]) == (theirs["size"]["shortest_edge"], theirs["size"]["longest_edge"])
    assert ours["image_mean"] == tuple(theirs["image_mean"]) and ours["image_std"] == tuple(theirs["image_std"])
    for key in ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames", "max_video_tokens"):
        assert ours[key] == theirs[key], key
    assert ours["fps"] == theirs.get("fps") and ours["num_frames"] == theirs.get("num_frames")


@pytest.mark.parametrize("family, path, cls", [("qwen2", QWEN2, "Qwen2VLVideoProcessor"),
                                               ("qwen3", QWEN3, "Qwen3VLVideoProcessor")])
def test_frame_indices_are_transformers_own(family, path, cls):
    sample_frames = their(path, "sample_frames", cls)
    checked = 0
    for total in (5, 8, 31, 240, 1000):
        for native in (3.0, 24.0, 29.97):
            for fps, num_frames, low, high in ((2.0, None, 4, 768), (0.5, None, 4, 768), (8.0, None, 2, 16),
                                               (None, 6, 4, 768), (None, 9, 4, 768)):
                spec = VideoSpec(family=family, fps=fps, num_frames=num_frames, min_frames=low, max_frames=high)
                me = SimpleNamespace(fps=fps, num_frames=num_frames, min_frames=low, max_frames=high,
                                     temporal_patch_size=2)
                metadata = SimpleNamespace(total_num_frames=total, fps=native)
                try:
                    expected = [int(i) for i in sample_frames(me, metadata, fps=fps, num_frames=num_frames)]
                except (ValueError, ZeroDivisionError):
                    with pytest.raises(ValueError):
                        spec.frame_indices(total, native)
                    continue
                assert spec.frame_indices(total, native) == expected, (total, native, fps, num_frames, low, high)
                checked += 1
    assert checked > 60  # of 75: the rest are too short for the rule, and raise in both


@pytest.mark.parametrize("family, path", [("qwen2", QWEN2), ("qwen3", QWEN3)])
def test_clip_sizes_are_transformers_smart_resize(family, path):
    smart_resize = their(path, "smart_resize")
    factor = 28 if family == "qwen2" else 32
    for frames in (2, 4, 7, 64):
        for height, width in ((60, 90), (224, 224), (1080, 1920), (20, 500), (480, 36)):
            for low, high in ((128 * factor ** 2, 768 * factor ** 2), (4 * factor ** 2, 12 * factor ** 2),
                              (4 * factor ** 2, 64 * 12 * factor ** 2)):
                spec = VideoSpec(family=family, patch_size=factor // 2, min_pixels=low, max_pixels=high)
                if family == "qwen2":
                    expected = smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
                else:
                    expected = smart_resize(frames, height, width, 2, factor, low, high)
                assert spec.resized(frames, height, width) == expected, (frames, height, width, low, high)


@pytest.mark.parametrize("family, path", [("qwen2", QWEN2), ("qwen3", QWEN3)])
@pytest.mark.parametrize("frames", [4, 5])
def test_patches_and_times_are_transformers_own(family, path, frames):
    """A clip already at its resized size: normalize by hand, then transformers' patchify."""
    patchify = their(path, "patchify", "Qwen2VLVideoProcessor" if family == "qwen2" else "Qwen3VLVideoProcessor")
    spec = VideoSpec(family=family, **{**VIDEO_FAMILIES[family], "fps": 2.0, "min_pixels": 1, "max_pixels": 10 ** 9},
                     seconds=True)
    size = 4 * spec.patch_size * spec.merge_size
    pixels = np.random.default_rng(0).integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
    clip = Clip(pixels, [0, 3, 7, 10, 13][:frames], 6.0, 15)
    assert spec.resized(frames, size, size) == (size, size)
    video = process_video(clip, spec)
    mean, std = torch.tensor(spec.image_mean).view(1, 1, 3, 1, 1), torch.tensor(spec.image_std).view(1, 1, 3, 1, 1)
    normalized = (torch.from_numpy(pixels).permute(0, 3, 1, 2)[None].float() / 255 - mean) / std
    expected, t, h, w = patchify(None, normalized, spec.patch_size, spec.merge_size, spec.temporal_patch_size)
    assert video.grid.tolist() == [t, h, w]
    torch.testing.assert_close(video.pixel_values, expected[0], atol=1e-5, rtol=0)
    calculate = their(TRANSFORMERS / "models" / "qwen3_vl" / "processing_qwen3_vl.py", "_calculate_timestamps",
                      "Qwen3VLProcessor")
    assert video.group_seconds == pytest.approx(calculate(None, list(clip.indices), clip.fps, 2))
    assert video.second_per_grid == pytest.approx(2 / (frames / 15 * 6.0))  # Qwen2.5-VL's processor


WIDE = {"min_pixels": 1, "max_pixels": 10 ** 9}
"""Bounds that leave a frame whose sides are multiples of 28 as it is."""


def test_read_video_keeps_the_sampled_frames_of_a_file_and_a_folder(tmp_path):
    decoded = write_clip(tmp_path / "clip.mp4", frames=12, height=56, width=84)
    spec = VideoSpec(family="qwen2", fps=2.0, **WIDE)
    clip = read_video(tmp_path / "clip.mp4", spec)
    assert (clip.total, clip.fps, clip.indices) == (12, 6.0, [0, 3, 6, 9])
    assert all(np.array_equal(frame, decoded[i]) for frame, i in zip(clip.frames, clip.indices, strict=True))
    # resized as they are read, each frame as the whole clip at once would be
    tight = VideoSpec(family="qwen2", fps=2.0, min_pixels=1, max_pixels=28 * 56)
    small = read_video(tmp_path / "clip.mp4", tight)
    whole = torch.from_numpy(np.stack([decoded[i] for i in small.indices])).permute(0, 3, 1, 2)
    assert tight.resized(4, 56, 84) == (28, 28)
    whole = torch.nn.functional.interpolate(whole, size=(28, 28), mode="bicubic", antialias=True)
    assert small.resized and torch.equal(torch.from_numpy(small.frames).permute(0, 3, 1, 2), whole)
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(decoded[:7]):
        Image.fromarray(frame).save(folder / f"{i:03d}.png")
    clip = read_video(folder, VideoSpec(family="qwen2", max_frames=768, **WIDE), fps=1.0)
    assert (clip.total, clip.fps, clip.indices) == (7, 1.0, list(range(7)))  # all: already sampled
    assert process_video(clip, VideoSpec(family="qwen2", min_pixels=1)).grid[0] == 4  # the last frame repeated
    clip = read_video(folder, VideoSpec(family="qwen2", max_frames=4, **WIDE))
    assert clip.indices == [0, 2, 4, 6]
    assert all(np.array_equal(frame, decoded[i]) for frame, i in zip(clip.frames, clip.indices, strict=True))
    clip = read_video([folder / "000.png", folder / "001.png", folder / "002.png"], VideoSpec(family="qwen3"))
    assert (clip.total, clip.fps, clip.indices) == (3, 2.0, [0, 1, 2])


# --- video records through SampleDataset, into the model's own forward

TOKENIZER = bundled_tokenizer()


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def vl_model(family: str):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config_dict(family)),
                                                   attn_implementation="eager").eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_video_records_become_samples_the_model_takes(tmp_path, family):
    """Every video style gives a sample whose video tokens match its grids as the family lays
    them out, unlabelled, with its patches counted, and which the model's own forward takes (it
    raises where tokens and video features differ, and builds its M-RoPE from them)."""
    media(tmp_path)
    model = vl_model(family)
    vision = vision_spec(model, SMALL, source=None)
    dataset = SampleDataset(write_records(tmp_path), VIDEO_TOKENIZER, SMALL, vision=vision)
    for index, videos in enumerate((1, 1, 2)):
        sample = dataset[index]
        assert "skip" not in sample, sample
        grids = sample["video_grid_thw"]
        assert len(grids) == videos and len(sample["pixel_values_videos"]) == int(grids.prod(dim=1).sum())
        ids = sample["input_ids"]
        assert int((ids == VIDEO_ID).sum()) == int(grids.prod(dim=1).sum()) // 4
        assert bool((sample["labels"][ids == VIDEO_ID] == -100).all())
        images = int(sample["image_grid_thw"].prod(dim=1).sum()) if "image_grid_thw" in sample else 0
        assert sample["patches"] == images + int(grids.prod(dim=1).sum())
        text = VIDEO_TOKENIZER.decode(ids)
        assert (" seconds>" in text) == (family == "qwen3_vl")
        assert ("second_per_grid_ts" in sample) == (family == "qwen2_5_vl")
        with torch.no_grad():
            out = model(labels=sample["labels"][None], **model_inputs(sample))
        assert torch.isfinite(out.loss)
    assert dataset[1]["video_grid_thw"][0, 0] == 2  # 4 frame images: 2 groups of 2


def test_bad_videos_are_skipped_with_their_reason_and_strict_names_them(tmp_path):
    media(tmp_path)
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 20)
    answer = {"role": "assistant", "content": "x"}
    rows = [
        {"messages": [{"role": "user", "content": [video_part("gone.mp4")]}, answer]},
        {"messages": [{"role": "user", "content": [video_part("broken.mp4")]}, answer]},
        {"messages": [{"role": "user", "content": [video_part(), video_part()]}, answer], "videos": ["clip.mp4"]},
        {"messages": [{"role": "user", "content": [video_part("clip.mp4")]}, answer], "videos": ["clip.mp4"]},
        {"messages": [{"role": "user", "content": "hi"}, answer]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    vision = vision_spec(vl_model("qwen2_vl"), SMALL)
    feed = SampleFeed(SampleDataset(path, VIDEO_TOKENIZER, SMALL, vision=vision), sample_sizes, num_workers=0)
    feed.deal(list(range(5)))
    costs = feed.fetch(list(range(5)))
    assert [c is None for c in costs] == [True, True, True, True, False]
    assert feed.skipped == Counter(missing_video=1, unreadable_video=1, video_placeholder_mismatch=1,
                                   mixed_video_sources=1)
    # a text model, and a VL model whose tokenizer has no video token of its own (the bundled one)
    text_model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=len(TOKENIZER))
    for tokenizer, model in ((TOKENIZER, text_model), (TOKENIZER, build_model(ROOT / "configs" / "tiny_vl_model.json",
                                                                               seed=0, vocab_size=len(TOKENIZER)))):
        dataset = SampleDataset(path, tokenizer, SMALL, vision=vision_spec(model, SMALL))
        skipped = dataset[0]
        assert skipped["skip"] == "video_not_supported", skipped
    strict = SampleFeed(SampleDataset(path, VIDEO_TOKENIZER, DataConfig(strict=True, video_fps=2.0), vision=vision),
                        sample_sizes, num_workers=0)
    strict.deal([1])
    with pytest.raises(DataError, match=r"d\.jsonl:2: unreadable_video: broken\.mp4"):
        strict.fetch([1])


def test_truncation_by_turns_drops_the_videos_of_the_turns_it_cuts(tmp_path):
    media(tmp_path)
    record = {"messages": [{"role": "user", "content": [video_part("frames"), {"type": "text", "text": "One?"}]},
                           {"role": "assistant", "content": "Yes."},
                           {"role": "user", "content": [video_part("long.mp4"), {"type": "text", "text": "Two?"}]},
                           {"role": "assistant", "content": "Also."}]}
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    vision = vision_spec(vl_model("qwen2_5_vl"), SMALL)
    whole = SampleDataset(path, VIDEO_TOKENIZER, SMALL, vision=vision)[0]
    assert len(whole["video_grid_thw"]) == 2
    cap = len(whole["input_ids"]) - 1
    cut = SampleDataset(path, VIDEO_TOKENIZER, SMALL, vision=vision, truncate_to=cap)[0]
    first = whole["video_grid_thw"][:1]
    assert torch.equal(cut["video_grid_thw"], first) and len(cut["second_per_grid_ts"]) == 1
    assert torch.equal(cut["pixel_values_videos"], whole["pixel_values_videos"][:int(first.prod())])
    assert cut["patches"] == int(first.prod()) and cut["truncated_tokens"] > 0
    assert int((cut["input_ids"] == VIDEO_ID).sum()) == int(first.prod()) // 4


def test_frame_folders_in_number_order_and_the_decoded_count_wins(tmp_path):
    rng = np.random.default_rng(5)
    frames = {i: rng.integers(0, 256, (28, 28, 3), dtype=np.uint8) for i in (1, 2, 10)}
    for i, frame in frames.items():
        Image.fromarray(frame).save(tmp_path / f"{i}.png")  # as text: 1, 10, 2
    clip = read_video(tmp_path, VideoSpec(family="qwen3", patch_size=14, **WIDE))
    assert all(np.array_equal(a, frames[i]) for a, i in zip(clip.frames, (1, 2, 10), strict=True))
    from odb.data.video_decode import _decode

    decoded = [SimpleNamespace(to_ndarray=lambda format, i=i: np.full((2, 2, 3), i)) for i in range(5)]
    out, count = _decode(iter(decoded), [0, 2, 4, 6])  # the container said 7 frames; 5 decode
    assert (len(out), count) == (3, 5)
    out, count = _decode(iter(decoded), [0, 0, 3])
    assert [int(a[0, 0, 0]) for a in out] == [0, 0, 3] and count == 4


def test_video_settings_from_a_folder_and_the_data_config(tmp_path):
    from odb.data.videos import video_spec_for

    model = vl_model("qwen3_vl")
    config = model.config
    config.vision_config.patch_size = 16
    assert video_spec_for(config, tmp_path).patch_size == 16  # no processor file: the tower's geometry
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"num_frames": 8, "min_pixels": 1, "patch_size": 16, "size": {"shortest_edge": 4096, "longest_edge": 9999}}))
    spec = video_spec_for(config, tmp_path, fps=4.0)
    assert (spec.fps, spec.num_frames, spec.min_pixels, spec.max_pixels) == (4.0, None, 4096, 9999)  # Qwen3 ignores
    assert video_spec_for(config, tmp_path).num_frames == 8  # its top-level min_pixels, as transformers does
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"patch_size": 16, "fps": 1}}))
    assert video_spec_for(config, tmp_path).fps == 1
    with pytest.raises(ValueError, match="num_frames 1 is under one group of 2"):
        video_spec_for(config, tmp_path, num_frames=1)


def test_a_video_in_an_answer_is_never_a_label_and_empty_video_fields_are_absent(tmp_path):
    media(tmp_path)
    answer = [video_part("clip.mp4"), {"type": "text", "text": "Here"}]
    record = {"messages": [{"role": "user", "content": "Show me."}, {"role": "assistant", "content": answer}],
              "video": []}
    vision = vision_spec(vl_model("qwen3_vl"), SMALL)
    sample = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), VIDEO_TOKENIZER, SMALL, vision=vision)[0]
    tokens = VIDEO_TOKENIZER.convert_ids_to_tokens(sample["input_ids"].tolist())
    labelled = [t for t, label in zip(tokens, sample["labels"].tolist()) if label != -100]
    assert "seconds" not in "".join(labelled) and "<|vision_start|>" not in labelled
    assert "<|vision_end|>" not in labelled and "Here" in VIDEO_TOKENIZER.convert_tokens_to_string(labelled)


def annotated_names(path: Path, cls: str) -> set[str]:
    """The keys a transformers TypedDict of kwargs declares (read from its source)."""
    body = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.target.id for n in body if isinstance(n, ast.AnnAssign)}


@pytest.mark.parametrize("family, path, kwargs", [("qwen2", QWEN2, "Qwen2VLVideoProcessorInitKwargs"),
                                                  ("qwen3", QWEN3, "Qwen3VLVideoProcessorInitKwargs")])
def test_the_exported_video_processor_has_only_keys_transformers_takes(family, path, kwargs):
    """The export's video_preprocessor_config.json (VideoSpec.processor_config): every key one the
    family's video processor takes, and a frame count only where transformers can keep it."""
    allowed = annotated_names(TRANSFORMERS / "processing_utils.py", "VideosKwargs") | annotated_names(path, kwargs)
    config = VideoSpec(family=family, fps=3.0).processor_config()
    assert set(config) - {"video_processor_type"} <= allowed, sorted(set(config) - allowed)
    assert (config["fps"], config["num_frames"], config["do_sample_frames"]) == (3.0, None, True)
    counted = VideoSpec(family=family, num_frames=8).processor_config()
    # Qwen3-VL's class rate (2) takes over a null fps, and a rate with a count is refused: it keeps the rate
    assert (counted["fps"], counted["num_frames"]) == ((None, 8) if family == "qwen2" else (2.0, None))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_video_max_tokens_bounds_a_video_or_its_frames(family):
    """The data config's video_max_tokens turns on the processor's cap: Qwen2-VL bounds the whole
    clip (0.9 x the tokens), Qwen3-VL each frame (the tokens in patches). The maths of the cap is
    transformers' own (tools/check/check_video_processor.py's cap_per_frame cases: 0 difference)."""
    from odb.data.videos import video_spec_for

    config = AutoConfig.for_model(**config_dict(family))
    settings = DataConfig(video_max_tokens=64, video_min_pixels=4 * 28 * 28).video_settings()
    spec = video_spec_for(config, None, **settings)
    assert spec.cap_pixels_per_frame and spec.max_video_tokens == 64
    unbounded = video_spec_for(config, None, **DataConfig(video_min_pixels=4 * 28 * 28).video_settings())
    for frames in (2, 8):  # (Qwen3-VL's own per-clip bound takes over from 24 frames of this size)
        height, width = spec.resized(frames, 480, 640)
        assert (height, width) != unbounded.resized(frames, 480, 640)
        per_frame = height * width // (28 * 28)  # visual tokens of one frame
        if family == "qwen2_vl":
            assert frames // 2 * per_frame <= 0.9 * 64 or height * width <= 1.05 * 4 * 28 * 28 + 2 * 28 * 28
        else:
            assert height * width <= 64 * 28 * 28


def test_a_folder_without_a_video_config_gets_the_video_processor_transformers_infers(tmp_path):
    """transformers' AutoVideoProcessor reads an image-only folder's image processor type with
    "Image" as "Video" (Qwen2VLImageProcessor -> Qwen2VLVideoProcessor, also for a Qwen3-VL model);
    the token layout stays the model's (Qwen3-VL's group times)."""
    from odb.data.images import vision_spec_for
    from odb.data.videos import Video, expand_video, video_spec_for

    config = AutoConfig.for_model(**config_dict("qwen3_vl"))
    vision_spec_for(config).build().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())["image_processor_type"] == \
        "Qwen2VLImageProcessor"
    spec = video_spec_for(config, tmp_path)
    assert (spec.family, spec.layout) == ("qwen2", "qwen3")
    video = Video(torch.zeros(16, 1), torch.tensor([2, 2, 4]), [0.25, 1.25], 1.0)
    assert expand_video(video, spec, ("S", "V", "E")) == "S<0.2 seconds>SVVE<1.2 seconds>SVVEE"
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_spec_for(config, None)
                                                                       .processor_config()))
    assert (video_spec_for(config, tmp_path).family, video_spec_for(config, tmp_path).layout) == ("qwen3", "qwen3")


@pytest.mark.parametrize("family, path", [("qwen2", QWEN2), ("qwen3", QWEN3)])
def test_the_largest_frame_is_the_largest_transformers_smart_resize_makes(family, path):
    """VideoSpec.largest_frame (the preflight's worst-case clips) against a brute force over frames
    of 1 to 200 squares a side through transformers' smart_resize: the most pixels it makes of a
    clip, under a bound of 768 squares and of 8 (where a thin frame comes out over the bound), at
    most a number of visual tokens where asked."""
    smart_resize = their(path, "smart_resize")
    factor = 28 if family == "qwen2" else 32
    for low, high in ((128 * factor ** 2, 768 * factor ** 2), (4 * factor ** 2, 8 * factor ** 2)):
        spec = VideoSpec(family=family, patch_size=factor // 2, min_pixels=low, max_pixels=high)
        for frames in (2, 8):
            made = set()
            for rows in range(1, 201):
                for cols in range(rows, 201):
                    try:
                        if family == "qwen2":
                            h, w = smart_resize(rows * factor, cols * factor, factor=factor, min_pixels=low,
                                                max_pixels=high)
                        else:
                            h, w = smart_resize(frames, rows * factor, cols * factor, 2, factor, low, high)
                    except ValueError:
                        continue
                    made.add(h * w // factor ** 2)
            for tokens in (None, 5, 300):
                expected = max((s for s in made if tokens is None or s <= tokens), default=None)
                frame = spec.largest_frame(frames, tokens=tokens)
                got = frame[0] * frame[1] // factor ** 2 if frame is not None else None
                assert got == expected, (low, high, frames, tokens, frame)
