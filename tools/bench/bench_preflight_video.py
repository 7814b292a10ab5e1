#!/usr/bin/env python
"""The preflight's worst case of a model that takes videos, against a real micro-batch of long clips.

    python tools/bench/bench_preflight_video.py --tokens 4096 --json

The tiny Qwen2-VL of configs/tiny_vl_model.json with a video token of its own (id 8; the bundled
config maps video to the image token), odb's attention, one probe step
(:meth:`odb.training.step.engine.OdbEngine.probe_step`: forward, zero-weight backward) of one
micro-batch of ``--tokens`` tokens, measured as the preflight measures it on the CPU
(:func:`odb.training.run.preflight.measure`: the growth of the resident set), each case in a
fresh process after a warm-up step, the larger of two steps:

* images: the preflight's image case (:func:`worst_images`: the largest images, as many as half
  the tokens hold), all it probed before it knew videos;
* videos: its video case (:func:`worst_videos`: the largest clips the model's video processor
  makes, as many as the tokens hold);
* clips: a real micro-batch of long clips: frames of 896 x 672 (the largest the processor keeps,
  768 visual tokens a temporal group) through odb's video processing (:func:`process_video`),
  as many groups as the tokens hold, laid out as Qwen2-VL's processor does, the rest text;
* pictures: a micro-batch of images with short texts: images of the largest size, as many as all
  the tokens hold (what the images' case leaves out: it gives half the tokens to text).

The last line of stdout is one JSON object (with ``--json``): per case its patches and peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ("images", "videos", "clips", "pictures")
VIDEO_TOKEN = 8


def run_case(case: str, tokens: int) -> dict:
    import numpy as np
    import torch

    from odb.data.config import DataConfig
    from odb.data.videos import Clip, process_video
    from odb.training.backends.base import LocalBackend
    from odb.training.model.build import build_model, vision_spec
    from odb.training.run.preflight import measure
    from odb.training.run.worst_case import (
        image_sample,
        special_token_ids,
        worst_case_batches,
        worst_images,
        worst_videos,
    )
    from odb.training.step.engine import OdbEngine

    torch.set_num_threads(1)
    path = Path(tempfile.mkdtemp()) / "tiny_vl_video.json"
    path.write_text(json.dumps({**json.loads((ROOT / "configs" / "tiny_vl_model.json").read_text()),
                                "video_token_id": VIDEO_TOKEN}))
    model = build_model(path, seed=0, vocab_size=1024)
    config, spec = model.config, vision_spec(model, DataConfig())
    engine = OdbEngine(LocalBackend(model), world_size=1, max_tokens=tokens, pad_token_id=0)
    avoid = special_token_ids(config)
    if case == "images":
        media = worst_images(config, tokens, largest_image=spec.max_pixels // spec.patch_size ** 2, max_patches=None)
    elif case == "pictures":
        largest = spec.max_pixels // spec.patch_size ** 2
        media = image_sample(config, image_patches=largest, images=(tokens - 1) // (largest // 4 + 2))
    elif case == "videos":
        media = worst_videos(config, spec.video, tokens, max_patches=None, text_ids=lambda text: [9] * 6)
    else:
        height, width = 896, 672
        per_group = (height // 14) * (width // 14) // 4
        groups = (tokens - 3) // per_group
        frames = np.zeros((2 * groups, height, width, 3), np.uint8)
        video = process_video(Clip(frames, list(range(2 * groups)), 2.0, 2 * groups), spec.video)
        ids = torch.tensor([config.vision_start_token_id] + [VIDEO_TOKEN] * (groups * per_group)
                           + [config.vision_end_token_id])
        media = {"input_ids": ids, "labels": torch.full_like(ids, -100), "pixel_values_videos": video.pixel_values,
                 "video_grid_thw": video.grid[None], "patches": int(video.grid.prod())}
    batch = worst_case_batches(tokens, vocab_size=1024, avoid=avoid, visual=[media])[0]
    engine.probe_step(worst_case_batches(64, vocab_size=1024, avoid=avoid)[0])
    peaks = [measure(lambda: engine.probe_step(batch), torch.device("cpu"))[0] for _ in range(2)]
    visual = int(sum(int(g.prod()) for g in media.get("video_grid_thw", media.get("image_grid_thw"))) // 4)
    return {"patches": int(media["patches"]), "visual_tokens": visual, "peak_mb": round(max(peaks), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # (one case, in this process)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens)))
        return
    results = {}
    for case in CASES:
        done = subprocess.run([sys.executable, __file__, "--case", case, "--tokens", str(args.tokens)],
                              capture_output=True, text=True, check=True)
        results[case] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{case}: {results[case]}", file=sys.stderr)
    if args.json:
        print(json.dumps({"tokens": args.tokens, **results}))


if __name__ == "__main__":
    main()
