"""The preflight's worst-case micro-batches (:mod:`odb.training.run.preflight`): at a budget, one
sample of the whole budget and the budget as :data:`PACKED_SAMPLES` packed samples, every label
counted, token ids that are no special token of the model; for a vision model the largest images
the data can hold (:func:`worst_images`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from odb.training.run.budget import QUANTUM

__all__ = ["PACKED_SAMPLES", "image_sample", "special_token_ids", "worst_case_batches", "worst_images"]

PACKED_SAMPLES = 8
"""The packed shape's samples per micro-batch (the budget's tokens in equal parts)."""


WARMUP_TOKENS = QUANTUM
"""The first step's size: it allocates the optimizer's state, so the measured trials see it resident,
as every step of the run does."""


# ---- the worst-case micro-batches ---------------------------------------------------------------

def worst_case_batches(budget: int, *, vocab_size: int, avoid: set[int], image: dict[str, Any] | None = None
                       ) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches of a budget: one sample of ``budget`` tokens, and ``budget`` tokens as
    :data:`PACKED_SAMPLES` samples (fewer if the budget is small); every label counts. Token ids
    are seeded and never one of ``avoid`` (a model's image, video or vision start/end tokens).
    ``image``: a vision model's worst-case image sample (:func:`image_sample`), which then opens
    the one-sample shape (its tokens out of the budget's)."""
    generator = torch.Generator().manual_seed(budget)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in avoid])

    def text(tokens: int) -> dict[str, torch.Tensor]:
        ids = allowed[torch.randint(len(allowed), (tokens,), generator=generator)]
        return {"input_ids": ids, "labels": ids.clone()}

    parts = min(PACKED_SAMPLES, budget)
    packed = [text(budget // parts + (1 if i < budget % parts else 0)) for i in range(parts)]
    if image is None:
        return [[text(budget)], packed]
    rest = budget - len(image["input_ids"])
    one = [{**image, "input_ids": torch.cat([image["input_ids"], text(rest)["input_ids"]]) if rest > 0
            else image["input_ids"]}]
    one[0]["labels"] = torch.cat([image["labels"], one[0]["input_ids"][len(image["labels"]):]])
    return [one, packed]


def image_sample(model_config, *, image_patches: int, images: int = 1) -> dict[str, torch.Tensor]:
    """A sample of ``images`` images, each about ``image_patches`` vision patches (a grid of whole
    merged tokens, as square as it goes) between the vision start and end tokens, its labels all
    -100; ``sample["patches"]`` is the patch count."""
    spec, merge = model_config.vision_config, model_config.vision_config.spatial_merge_size
    tokens = max(1, image_patches // (merge * merge))
    rows = max(1, math.isqrt(tokens))
    cols = max(1, tokens // rows)
    grid = torch.tensor([[1, rows * merge, cols * merge]] * max(1, images))
    count = int(grid.prod(dim=1).sum())
    width = spec.in_channels * spec.temporal_patch_size * spec.patch_size ** 2
    one = [model_config.vision_start_token_id] + [model_config.image_token_id] * (rows * cols) \
        + [model_config.vision_end_token_id]
    ids = torch.tensor(one * max(1, images))
    pixels = torch.randn((count, width), generator=torch.Generator().manual_seed(count))
    return {"input_ids": ids, "labels": torch.full_like(ids, -100), "pixel_values": pixels,
            "image_grid_thw": grid, "patches": count}


def worst_images(model_config, tokens: int, *, largest_image: int, max_patches: int | None
                 ) -> dict[str, torch.Tensor]:
    """The most vision patches a micro-batch of ``tokens`` tokens can hold: images of the largest
    size the processor makes (``largest_image`` patches), as many as the tokens hold (half of
    them at least left for text), at most ``max_patches`` patches in all where the run caps them."""
    merge2 = model_config.vision_config.spatial_merge_size ** 2
    per_image = min(largest_image, max_patches) if max_patches else largest_image
    per_image = max(merge2, min(per_image, max(1, tokens // 2 - 2) * merge2))
    image_tokens = per_image // merge2 + 2
    images = max(1, (tokens // 2) // image_tokens)
    if max_patches:
        images = max(1, min(images, max_patches // per_image))
    return image_sample(model_config, image_patches=per_image, images=images)


def special_token_ids(model_config) -> set[int]:
    """The ids a synthetic text must not use: every ``*_token_id`` / ``*_token_index`` of the
    model's config (image, video, vision start and end, ...), the nested text config's too."""
    ids: set[int] = set()
    for config in (model_config, getattr(model_config, "text_config", None)):
        for key, value in (vars(config).items() if config is not None else ()):
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) \
                    and not isinstance(value, bool):
                ids.add(value)
    plain: set[int] = set()  # the pad, bos and eos tokens (eos may be a list: Llama-3.1's) are text
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(model_config, name, None)
        plain.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return ids - plain
