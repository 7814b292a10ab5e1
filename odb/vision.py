"""Images the Qwen2-VL / Qwen3-VL way: resized within [min_pixels, max_pixels], cut into
``patch_size`` patches (``temporal_patch_size`` frames), merged ``merge_size x merge_size`` into
one visual token each. A sample's ``<image>`` becomes ``<|vision_start|>`` + one ``<|image_pad|>``
per visual token + ``<|vision_end|>``, so its cost (tokens and vision patches) is exact.

Packed rows need each sample's multimodal rotary positions (M-RoPE) computed on its own:
:func:`packed_position_ids` builds the ``[4, 1, T]`` positions transformers' Qwen2-VL family
accepts for packed input (row 0: text positions restarting per sample; rows 1-3: M-RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VisionSpec", "ImageProcessor", "expand_placeholders", "packed_position_ids", "supports_packing"]

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


def supports_packing(model) -> bool:
    """Text causal LMs pack; multimodal models pack when odb knows their rotary positions.

    ``model`` may be wrapped by PEFT: the check looks at the Hugging Face model inside.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "vision_config", None) is None:
        return True
    return hasattr(getattr(base, "model", None), "get_rope_index")


def packed_position_ids(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                        image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """``[4, 1, T]`` positions of a packed row: text positions, then each sample's M-RoPE."""
    inner = model.model
    image_token = model.config.image_token_id
    merge = model.config.vision_config.spatial_merge_size
    bounds = cu_seqlens.tolist()
    grids = iter(image_grid_thw if image_grid_thw is not None else [])
    rows = []
    for start, end in zip(bounds, bounds[1:]):
        ids = input_ids[0, start:end][None]
        mm = (ids == image_token).int()
        count, own = int(mm.sum()), []
        while count > 0:
            grid = next(grids)
            own.append(grid)
            count -= int(grid.prod()) // (merge * merge)
        grid_thw = torch.stack(own) if own else None
        mrope, _ = inner.get_rope_index(ids, mm, image_grid_thw=grid_thw)
        text = torch.arange(end - start, device=input_ids.device)[None, None]
        rows.append(torch.cat([text, mrope.to(input_ids.device)], dim=0))
    return torch.cat(rows, dim=2)
