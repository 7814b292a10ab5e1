"""check-model's processor checks: odb's image and video pixel values against the model folder's own
transformers processors (:func:`image_processor_diff`, :func:`video_processor_diff`), where the
folder has them and transformers can run them here (its video processors need torchvision)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from odb.data.images import ImageProcessor, VisionSpec
from odb.data.videos import Clip, VideoSpec, process_video

__all__ = ["image_processor_diff", "video_processor_diff"]

if TYPE_CHECKING:
    from odb.training.check_model import ModelReport


def image_processor_diff(path: str | Path, vision: VisionSpec, report: ModelReport) -> float | None:
    """Max |odb's pixel_values - the folder's own processor's| on two seeded noise images of other
    shapes, with odb's pixel bounds; None where there is no folder processor to compare with."""
    from PIL import Image
    from transformers import AutoImageProcessor

    folder = Path(path)
    if not folder.is_dir():
        return None  # a config JSON: the family's processor, nothing of the model's own to compare with
    if not any((folder / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        report.problems.append(f"{folder} has no preprocessor_config.json: odb processes images with transformers' "
                               "defaults for the family, which may not be the model's; copy the base model's into it")
        return None
    gen = torch.Generator().manual_seed(0)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy())
              for h, w in ((210, 330), (500, 90))]
    mine, mine_grid = ImageProcessor(vision)(images)
    bounds = {"min_pixels": vision.min_pixels, "max_pixels": vision.max_pixels}  # (a config's own keys win over size)
    own = AutoImageProcessor.from_pretrained(str(folder), **bounds, size={"shortest_edge": vision.min_pixels,
                                                                          "longest_edge": vision.max_pixels})
    theirs = own(images=images, return_tensors="pt")
    if not torch.equal(mine_grid, theirs["image_grid_thw"]) or mine.shape != theirs["pixel_values"].shape:
        report.problems.append(f"odb's image grids {mine_grid.tolist()} differ from the folder processor's "
                               f"{theirs['image_grid_thw'].tolist()}")
        return float("inf")
    return float((mine - theirs["pixel_values"]).abs().max())


def video_processor_diff(path: str | Path, video: VideoSpec, report: ModelReport) -> float | None:
    """Max |odb's pixel_values_videos - the folder's own video processor's| on two clips of seeded
    noise frames, with odb's settings; None where there is no folder, or no torchvision to run
    transformers' video processor (said in ``notes``)."""
    from transformers.utils import is_torchvision_available

    folder = Path(path)
    if not folder.is_dir():
        return None
    if not any((folder / name).is_file() for name in ("video_preprocessor_config.json", "processor_config.json",
                                                      "preprocessor_config.json")):
        report.notes.append(f"video processor not compared: {folder} has no processor config for transformers' "
                            "AutoVideoProcessor to load")
        return None
    if not is_torchvision_available():
        report.notes.append("video processor not compared: transformers' video processors need torchvision, which "
                            "is not installed here (tools/check/check_video_processor.py compares odb's with them)")
        return None
    from transformers import AutoVideoProcessor

    own = AutoVideoProcessor.from_pretrained(str(folder))
    own.size = {"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels}
    own.cap_pixels_per_frame, own.max_video_tokens = video.cap_pixels_per_frame, video.max_video_tokens
    gen, worst = torch.Generator().manual_seed(0), 0.0
    for frames, height, width in ((5, 210, 330), (8, 90, 500)):
        pixels = torch.randint(0, 256, (frames, height, width, 3), generator=gen, dtype=torch.uint8)
        mine = process_video(Clip(pixels.numpy(), list(range(frames)), 2.0, frames), video)
        theirs = own(videos=[pixels.permute(0, 3, 1, 2)], do_sample_frames=False, return_tensors="pt")
        if theirs["video_grid_thw"][0].tolist() != mine.grid.tolist():
            report.problems.append(f"odb's video grid {mine.grid.tolist()} differs from the folder processor's "
                                   f"{theirs['video_grid_thw'][0].tolist()}")
            return float("inf")
        worst = max(worst, float((mine.pixel_values - theirs["pixel_values_videos"]).abs().max()))
    return worst
