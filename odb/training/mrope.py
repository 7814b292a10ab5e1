"""Multimodal rotary positions (M-RoPE) of packed rows, the Qwen2-VL family's way.

Packed rows need each sample's M-RoPE computed on its own: :func:`packed_position_ids` builds the
``[4, 1, T]`` positions transformers' Qwen2-VL family accepts for packed input (row 0: text
positions restarting per sample; rows 1-3: M-RoPE). :func:`supports_packing` says whether odb
knows a model's rotary positions (else the run trains padded micro-batches).
"""

from __future__ import annotations

import torch

from odb.training.model import hf_model

__all__ = ["mm_token_types", "packed_position_ids", "supports_packing"]


def supports_packing(model) -> bool:
    """Text causal LMs pack; multimodal models pack when odb knows their rotary positions.

    ``model`` may be wrapped by PEFT: the check looks at the Hugging Face model inside.
    """
    base = hf_model(model)
    if getattr(base.config, "vision_config", None) is None:
        return True
    return hasattr(getattr(base, "model", None), "get_rope_index")


def mm_token_types(input_ids: torch.Tensor, config) -> torch.Tensor:
    """``mm_token_type_ids`` as the family's processor returns them: 1 on image tokens, 2 on video
    tokens (where the model has a token of its own for video), 0 elsewhere."""
    types = (input_ids == config.image_token_id).int()
    video = getattr(config, "video_token_id", None)
    if video is not None and video != config.image_token_id:
        types = types + 2 * (input_ids == video).int()
    return types


def _own(grids, count: int, merge: int, seconds=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The next grids (and their seconds per temporal patch) of ``grids`` that hold ``count`` tokens."""
    own, own_seconds = [], []
    while count > 0:
        grid = next(grids, None)
        if grid is None:
            raise ValueError(f"a packed sample has {count} more image or video tokens than the micro-batch's grids "
                             "hold (a sample cut inside an image or video?)")
        own.append(grid)
        if seconds is not None:
            own_seconds.append(next(seconds))
        count -= int(grid.prod()) // (merge * merge)
    return own, own_seconds


def packed_position_ids(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                        image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None = None,
                        second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
    """``[4, 1, T]`` positions of a packed row: text positions, then each sample's M-RoPE, from the
    model's own ``get_rope_index`` on that sample alone with its own images and videos (and, for
    Qwen2.5-VL, its videos' seconds per temporal patch)."""
    inner = model.model
    merge = model.config.vision_config.spatial_merge_size
    bounds = cu_seqlens.tolist()
    images = iter(image_grid_thw if image_grid_thw is not None else [])
    videos = iter(video_grid_thw if video_grid_thw is not None else [])
    seconds = iter(second_per_grid_ts) if second_per_grid_ts is not None else None
    row_types = mm_token_types(input_ids, model.config)  # once for the row, sliced per sample
    rows = []
    for start, end in zip(bounds, bounds[1:]):
        ids, types = input_ids[0, start:end][None], row_types[0, start:end][None]
        own_images, _ = _own(images, int((types == 1).sum()), merge)
        own_videos, own_seconds = _own(videos, int((types == 2).sum()), merge, seconds)
        extra = {"second_per_grid_ts": torch.stack(own_seconds)} if own_seconds else {}
        mrope, _ = inner.get_rope_index(ids, types, image_grid_thw=torch.stack(own_images) if own_images else None,
                                        video_grid_thw=torch.stack(own_videos) if own_videos else None, **extra)
        text = torch.arange(end - start, device=input_ids.device)[None, None]
        rows.append(torch.cat([text, mrope.to(input_ids.device)], dim=0))
    return torch.cat(rows, dim=2)
