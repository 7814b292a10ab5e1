"""Multimodal rotary positions (M-RoPE) of packed rows, the Qwen2-VL family's way.

Packed rows need each sample's M-RoPE computed on its own: :func:`packed_position_ids` builds the
``[4, 1, T]`` positions transformers' Qwen2-VL family accepts for packed input (row 0: text
positions restarting per sample; rows 1-3: M-RoPE). :func:`supports_packing` says whether odb
knows a model's rotary positions (else the run trains padded micro-batches).
:func:`padded_position_ids` is the model's own computation for padded rows, made before the call.

Once the positions are known, :func:`videos_as_images` hands a micro-batch's videos to the model
as images: one vision-tower call per micro-batch whatever it holds. The tower treats an image and
a video alike (patches and their ``(t, h, w)`` grid; attention within each); what differs is only
the positions (made above from the video tokens) and which embeddings the features replace (now
the image tokens, which were the video tokens, in the same order). Every rank then calls the
tower once per micro-batch, as ZeRO-3's and FSDP2's per-module gathers need, with or without
videos (a micro-batch with neither gets the blank image, :mod:`odb.training.step.engine`).
"""

from __future__ import annotations

import torch

from odb.training.model.build import hf_model

__all__ = ["mm_token_types", "packed_position_ids", "padded_position_ids", "supports_packing", "videos_as_images"]


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


def padded_position_ids(model, batch: dict) -> torch.Tensor:
    """``[3, B, L]`` M-RoPE positions of padded rows: the model's own ``get_rope_index`` over the
    batch, with the arguments its forward gives it (Qwen2.5-VL: the videos' seconds too)."""
    extra = {"second_per_grid_ts": batch["second_per_grid_ts"]} if batch.get("second_per_grid_ts") is not None else {}
    positions, _ = model.model.get_rope_index(
        batch["input_ids"], mm_token_type_ids=mm_token_types(batch["input_ids"], model.config),
        image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
        attention_mask=batch.get("attention_mask"), **extra)
    return positions


def videos_as_images(batch: dict, config) -> None:
    """Moves ``batch``'s videos into its images, in place (the module docstring): their patches and
    grids join the images' in the order their tokens come in the rows, and their tokens become
    image tokens. Call it after the positions are made."""
    if batch.get("pixel_values_videos") is None:
        return
    ids, merge = batch["input_ids"], config.vision_config.spatial_merge_size
    items = []  # (first token, patches, grid) of every image and video
    for pixels, grids, token in (("pixel_values", "image_grid_thw", config.image_token_id),
                                 ("pixel_values_videos", "video_grid_thw", config.video_token_id)):
        if batch.get(grids) is None:
            continue
        at = (ids.flatten() == token).nonzero().flatten().tolist()
        sizes = batch[grids].prod(dim=1).tolist()
        token_at = patch_at = 0
        for grid, size in zip(batch[grids], sizes):
            if token_at >= len(at):
                raise ValueError(f"the micro-batch has fewer tokens {token} than its {grids} hold")
            items.append((at[token_at], batch[pixels][patch_at:patch_at + size], grid))
            token_at, patch_at = token_at + size // (merge * merge), patch_at + size
        if token_at != len(at) or patch_at != len(batch[pixels]):
            raise ValueError(f"the micro-batch has {len(at)} tokens {token} and {len(batch[pixels])} {pixels} rows, "
                             f"but its {grids} make {token_at} and {patch_at}")
    items.sort(key=lambda item: item[0])
    batch["pixel_values"] = torch.cat([patches for _, patches, _ in items])
    batch["image_grid_thw"] = torch.stack([grid for _, _, grid in items])
    batch["input_ids"] = torch.where(ids == config.video_token_id, config.image_token_id, ids)
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        batch.pop(key, None)
