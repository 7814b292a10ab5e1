"""Images the Qwen2-VL / Qwen3-VL way: resized within [min_pixels, max_pixels], cut into
``patch_size`` patches (``temporal_patch_size`` frames), merged ``merge_size x merge_size`` into
one visual token each. A sample's ``<image>`` becomes ``<|vision_start|>`` + one ``<|image_pad|>``
per visual token + ``<|vision_end|>``, so its cost (tokens and vision patches) is exact.
(The rotary positions of packed multimodal rows are the model's business: odb/training/mrope.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["IMAGE_PAD", "ImageProcessor", "VisionSpec", "expand_placeholders"]

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


@dataclass(frozen=True)
class VisionSpec:
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2


class ImageProcessor:
    """PIL images -> ``pixel_values [patches, C*T*P*P]`` and ``image_grid_thw [images, 3]``."""

    def __init__(self, spec: VisionSpec) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.spec = spec
        self.processor = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                                  patch_size=spec.patch_size, merge_size=spec.merge_size,
                                                  temporal_patch_size=spec.temporal_patch_size)

    def __call__(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def expand_placeholders(text: str, grids: list[torch.Tensor], merge_size: int, placeholder: str) -> str:
    """Each ``placeholder`` (in order) -> its image's visual tokens."""
    pieces = text.split(placeholder)
    out = [pieces[0]]
    for piece, grid in zip(pieces[1:], grids, strict=True):
        tokens = int(grid.prod()) // (merge_size * merge_size)
        out.append(VISION_START + IMAGE_PAD * tokens + VISION_END + piece)
    return "".join(out)
