"""odb's video processing (odb/data/videos.py) against transformers' own video processors.

transformers' Qwen-VL video processors need torchvision, so run this in an environment that has it
(on this project's CPU machines: a virtual environment with ``pip install torch==2.14.1
torchvision==0.29.1 transformers av`` and odb on ``PYTHONPATH``). For each family (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL), each clip (random frames of several sizes and lengths, written as MPEG-4
files and read back by odb) and each setting (the family's defaults; tight pixel bounds; the
per-frame pixel cap; a set frame count): the frame indices odb samples against the processor's
``sample_frames``, and ``pixel_values_videos`` / ``video_grid_thw`` against the processor's on the
same frames. Qwen3-VL's timestamps against its processor's ``_calculate_timestamps`` and Qwen2.5-VL's
``second_per_grid_ts`` against ``temporal_patch_size / sampled_fps``.

    PYTHONPATH=. python tools/check/check_video_processor.py [--folder MODEL_DIR ...]

Prints one line per case and the largest difference; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from odb.data.video_decode import read_video
from odb.data.videos import VIDEO_FAMILIES, VideoSpec, process_video, video_spec_for

CLIPS = ((12, 60, 90, 6.0), (31, 100, 70, 10.0), (9, 224, 224, 3.0), (48, 36, 200, 24.0))
"""(frames, height, width, fps) of the synthetic clips."""
SETTINGS = {
    "defaults": {},
    "tight": {"min_pixels": 4 * 28 * 28, "max_pixels": 12 * 28 * 28},
    "cap_per_frame": {"cap_pixels_per_frame": True, "max_video_tokens": 64, "min_pixels": 4 * 32 * 32},
    "num_frames": {"num_frames": 6},
}


def write_clip(path: Path, frames: int, height: int, width: int, fps: float, seed: int) -> None:
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = rng.integers(0, 255, (height, width, 3))
        for i in range(frames):
            image = np.clip(base + 8 * i + rng.integers(-20, 20, (height, width, 3)), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def their_processor(model_type: str, folder: str | None, settings: dict):
    from transformers import AutoVideoProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    kwargs = dict(settings)
    bounds = {k: kwargs.pop(k) for k in ("min_pixels", "max_pixels") if k in kwargs}
    if folder:
        processor = AutoVideoProcessor.from_pretrained(folder, **kwargs)
    else:
        cls = Qwen3VLVideoProcessor if model_type == "qwen3_vl" else Qwen2VLVideoProcessor
        processor = cls(**kwargs)
    if bounds:
        processor.size = {"shortest_edge": bounds.get("min_pixels", processor.size["shortest_edge"]),
                          "longest_edge": bounds.get("max_pixels", processor.size["longest_edge"])}
    if processor.cap_pixels_per_frame is None:
        processor.cap_pixels_per_frame = False
    return processor


def our_spec(model_type: str, processor, settings: dict) -> VideoSpec:
    family = "qwen3" if model_type == "qwen3_vl" else "qwen2"
    values = {k: getattr(processor, k) for k in VIDEO_FAMILIES[family] if k not in ("min_pixels", "max_pixels")}
    values.update(min_pixels=processor.size["shortest_edge"], max_pixels=processor.size["longest_edge"],
                  image_mean=tuple(processor.image_mean), image_std=tuple(processor.image_std),
                  rescale_factor=processor.rescale_factor, cap_pixels_per_frame=bool(processor.cap_pixels_per_frame))
    if "num_frames" in settings:
        values["fps"] = None
    return VideoSpec(family=family, seconds=model_type == "qwen2_5_vl", **values)


def check(model_type: str, folder: str | None, name: str, settings: dict, path: Path, clip_info) -> float:
    from transformers.video_utils import VideoMetadata

    processor = their_processor(model_type, folder, settings)
    if folder:  # odb reads the folder itself; both sample at the folder's own settings
        from transformers import AutoConfig

        spec = video_spec_for(AutoConfig.from_pretrained(folder), folder)
        sample_kwargs = {}
    else:
        spec = our_spec(model_type, processor, settings)
        sample_kwargs = {"num_frames": settings["num_frames"]} if "num_frames" in settings else {"fps": spec.fps or 2.0}
    clip = read_video(path, spec)
    metadata = VideoMetadata(total_num_frames=clip.total, fps=clip.fps, width=clip_info[2], height=clip_info[1])
    theirs_idx = [int(i) for i in processor.sample_frames(metadata=metadata, **sample_kwargs)]
    if theirs_idx != clip.indices:
        print(f"  {model_type} {name} {clip_info}: indices odb {clip.indices} transformers {theirs_idx}")
        return float("inf")
    import av

    with av.open(str(path)) as container:  # the sampled frames as decoded, full size: transformers resizes them
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    frames = torch.from_numpy(np.stack([decoded[i] for i in clip.indices])).permute(0, 3, 1, 2)
    out = processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    ours = process_video(clip, spec)
    if out["video_grid_thw"][0].tolist() != ours.grid.tolist():
        print(f"  {model_type} {name} {clip_info}: grid odb {ours.grid.tolist()} "
              f"transformers {out['video_grid_thw'][0].tolist()}")
        return float("inf")
    diff = float((out["pixel_values_videos"] - ours.pixel_values).abs().max())
    extra = ""
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        times = Qwen3VLProcessor._calculate_timestamps(None, list(clip.indices), clip.fps, spec.temporal_patch_size)
        diff = max(diff, max(abs(a - b) for a, b in zip(times, ours.group_seconds, strict=True)))
        extra = f" times {[round(t, 2) for t in ours.group_seconds]}"
    if model_type == "qwen2_5_vl":
        metadata.frames_indices = clip.indices
        seconds = spec.temporal_patch_size / metadata.sampled_fps
        diff = max(diff, abs(seconds - ours.second_per_grid))
        extra = f" second_per_grid {ours.second_per_grid:.4f}"
    print(f"  {model_type:10s} {name:13s} clip {clip_info}: {len(clip.indices)} frames, grid "
          f"{ours.grid.tolist()}, max |diff| {diff:.3g}{extra}")
    return diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", action="append", default=[],
                        help="also check a model folder's own video processor (its model_type from config.json), "
                             "e.g. one odb exported: odb reads the folder, transformers' AutoVideoProcessor too")
    args = parser.parse_args()
    import json

    cases = [(t, None) for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")]
    cases += [(json.loads((Path(f) / "config.json").read_text())["model_type"], f) for f in args.folder]
    worst, checked = 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, info in enumerate(CLIPS):
            paths.append(Path(tmp) / f"clip{i}.mp4")
            write_clip(paths[-1], *info, seed=i)
        for model_type, folder in cases:
            for name, settings in (SETTINGS if folder is None else {"folder": {}}).items():
                if model_type == "qwen3_vl" and name == "tight":
                    settings = {"min_pixels": 4 * 32 * 32, "max_pixels": 48 * 32 * 32}
                for path, info in zip(paths, CLIPS):
                    worst = max(worst, check(model_type, folder, name, settings, path, info))
                    checked += 1
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}: "
          f"largest difference {worst:.3g} over {checked} cases")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
