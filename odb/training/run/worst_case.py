"""The preflight's worst-case micro-batches (:mod:`odb.training.run.preflight`): at a budget, one
sample of the whole budget and the budget as :data:`PACKED_SAMPLES` packed samples, every label
counted, token ids that are no special token of the model; for a vision model the largest images
the data can hold (:func:`worst_images`) and, where it takes videos, the most video
(:func:`worst_videos`).

Why videos apart: a video's patches cost what an image's do (each patch a ``C x T x P x P`` row
of the tower's input, ``merge_size ** 2`` patches a visual token, attention within each temporal
group of ``h x w`` patches, as within an image), but a video sample is nearly all visual tokens (a
clip of many groups, a short question), where :func:`worst_images` leaves half the budget to text
and holds whole images of the largest size only. The tiny Qwen2-VL (configs/tiny_vl_model.json,
with a video token of its own) at 4096 tokens: the image case holds one image of 5040 patches, a
micro-batch of the largest clips 15360 patches, and its step peaks at 1.9x the image case's
memory (tools/bench/bench_preflight_video.py; docs/training.md, "The budget")."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from odb.data.videos import VideoSpec
from odb.training.run.budget import QUANTUM

__all__ = ["PACKED_SAMPLES", "image_sample", "special_token_ids", "worst_case_batches", "worst_images",
           "worst_videos"]

PACKED_SAMPLES = 8
"""The packed shape's samples per micro-batch (the budget's tokens in equal parts)."""


WARMUP_TOKENS = QUANTUM
"""The first step's size: it allocates the optimizer's state, so the measured trials see it resident,
as every step of the run does."""


# ---- the worst-case micro-batches ---------------------------------------------------------------

def worst_case_batches(budget: int, *, vocab_size: int, avoid: set[int], visual: Sequence[dict[str, Any]] = ()
                       ) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches of a budget: one sample of ``budget`` tokens, and ``budget`` tokens as
    :data:`PACKED_SAMPLES` samples (fewer if the budget is small); every label counts. Token ids
    are seeded and never one of ``avoid`` (a model's image, video or vision start/end tokens).
    ``visual``: a vision model's worst-case image and video samples (:func:`worst_images`,
    :func:`worst_videos`), each of which then opens a one-sample shape of its own (its tokens out
    of the budget's, text after them) in place of the text-only one."""
    generator = torch.Generator().manual_seed(budget)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in avoid])

    def text(tokens: int) -> dict[str, torch.Tensor]:
        ids = allowed[torch.randint(len(allowed), (tokens,), generator=generator)]
        return {"input_ids": ids, "labels": ids.clone()}

    parts = min(PACKED_SAMPLES, budget)
    packed = [text(budget // parts + (1 if i < budget % parts else 0)) for i in range(parts)]
    if not visual:
        return [[text(budget)], packed]
    shapes = []
    for media in visual:
        rest = text(max(0, budget - len(media["input_ids"])))["input_ids"]
        shapes.append([{**media, "input_ids": torch.cat([media["input_ids"], rest]),
                        "labels": torch.cat([media["labels"], rest])}])
    return [*shapes, packed]


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


def worst_videos(model_config, spec: VideoSpec, tokens: int, *, max_patches: int | None,
                 text_ids: Callable[[str], list[int]]) -> dict[str, Any] | None:
    """The most video a sample of ``tokens`` tokens can hold (one token left for its text), at
    most ``max_patches`` patches where the run caps them: clips of the largest frame the model's
    video processor makes (``spec``: :meth:`VideoSpec.largest_frame`, at the fewest frames a clip
    has), each of as many temporal groups as the processor keeps at that size (``max_frames``, or
    exactly ``num_frames``), laid out as the family's processor lays them out
    (:func:`odb.data.videos.expand_video`: Qwen3-VL's group times are tokenized by ``text_ids``);
    then, in the tokens left, the largest clip that still fits, until none does. Labels all -100;
    ``sample["patches"]`` is the patch count. None where not even one group fits."""
    temporal, merge2 = spec.temporal_patch_size, spec.merge_size ** 2
    start, video, end = (model_config.vision_start_token_id, model_config.video_token_id,
                         model_config.vision_end_token_id)
    times = (spec.layout or spec.family) != "qwen2"  # Qwen3-VL: each group's time, its own start and end
    stamps: list[list[int]] = []

    def stamp(group: int) -> list[int]:  # a group's time: the mean of its frames' times at the sampling rate
        while len(stamps) <= group:
            seconds = (len(stamps) * temporal + (temporal - 1) / 2) / spec.sampling_fps()
            stamps.append(list(text_ids(f"<{seconds:.1f} seconds>")))
        return stamps[group]

    def cost(groups: int, per_group: int) -> int:  # a clip's tokens
        return 2 + sum(len(stamp(g)) + 2 + per_group if times else per_group for g in range(groups))

    fixed = spec.num_frames  # every clip has that many frames (Qwen2-VL: rounded to whole groups)
    if fixed is not None and spec.family == "qwen2":
        fixed = round(fixed / temporal) * temporal
    room, patch_room = tokens - 1, max_patches if max_patches else tokens * merge2
    clips: list[tuple[int, int, int]] = []  # (groups, height, width)
    while True:
        groups = -(-fixed // temporal) if fixed else 1
        frames = fixed or temporal
        cap = min((room - cost(groups, 0)) // groups, patch_room // (groups * merge2))
        frame = spec.largest_frame(frames, tokens=cap) if cap > 0 else None
        if frame is None:
            break
        per_group = frame[0] * frame[1] // (spec.patch_size * spec.merge_size) ** 2
        if not fixed:  # as many groups as the processor keeps at this frame size, the room holds
            most = spec.max_frames // temporal
            while groups < most and cost(groups + 1, per_group) <= room and \
                    (groups + 1) * per_group * merge2 <= patch_room and \
                    _area(spec.largest_frame((groups + 1) * temporal, tokens=per_group)) == _area(frame):
                groups += 1
        clips.append((groups, *frame))
        room, patch_room = room - cost(groups, per_group), patch_room - groups * per_group * merge2
    if not clips:
        return None
    ids: list[int] = []
    for groups, height, width in clips:
        per_group = height * width // (spec.patch_size * spec.merge_size) ** 2
        body = [i for g in range(groups) for i in [*stamp(g), start, *[video] * per_group, end]] if times \
            else [video] * (groups * per_group)
        ids += [start, *body, end]
    grid = torch.tensor([[groups, height // spec.patch_size, width // spec.patch_size]
                         for groups, height, width in clips])
    count = int(grid.prod(dim=1).sum())
    width = model_config.vision_config.in_channels * temporal * spec.patch_size ** 2
    input_ids = torch.tensor(ids)
    sample = {"input_ids": input_ids, "labels": torch.full_like(input_ids, -100), "patches": count,
              "pixel_values_videos": torch.randn((count, width), generator=torch.Generator().manual_seed(count)),
              "video_grid_thw": grid}
    if spec.seconds:  # Qwen2.5-VL: the seconds per temporal group of each clip
        sample["second_per_grid_ts"] = torch.full((len(clips),), temporal / spec.sampling_fps())
    return sample


def _area(frame: tuple[int, int] | None) -> int:
    return frame[0] * frame[1] if frame is not None else 0


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
