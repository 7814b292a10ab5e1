"""Multimodal rotary positions (M-RoPE) of packed rows, the Qwen2-VL family's way.

Packed rows need each sample's M-RoPE computed on its own: :func:`packed_position_ids` builds the
``[4, 1, T]`` positions transformers' Qwen2-VL family accepts for packed input (row 0: text
positions restarting per sample; rows 1-3: M-RoPE). :func:`supports_packing` says whether odb
knows a model's rotary positions (else the run trains padded micro-batches).
"""

from __future__ import annotations

import torch

from odb.training.model import hf_model

__all__ = ["packed_position_ids", "supports_packing"]


def supports_packing(model) -> bool:
    """Text causal LMs pack; multimodal models pack when odb knows their rotary positions.

    ``model`` may be wrapped by PEFT: the check looks at the Hugging Face model inside.
    """
    base = hf_model(model)
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
