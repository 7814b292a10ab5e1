"""Images the model's own way: its image processor, and the visual tokens each image becomes.

The processor is the one the model ships (:func:`vision_spec_for`): a model folder's own
``preprocessor_config.json`` through ``AutoImageProcessor`` (so its mean, std, resampling, patch,
temporal patch and merge sizes are the model's: Qwen3-VL's 0.5 statistics and 16-pixel patches,
Qwen2/2.5-VL's CLIP statistics and 14-pixel patches), or, for a random-init config JSON, the
image processor class transformers maps the model type to, with its defaults and the vision
tower's patch, temporal patch and merge sizes. odb's data config may override only the pixel
bounds (``min_pixels``, ``max_pixels``; None keeps the processor's own).

The Qwen-VL processors resize an image within the bounds, cut it into ``patch_size`` patches
(``temporal_patch_size`` frames) and merge ``merge_size x merge_size`` patches into one visual
token. A sample's ``<image>`` becomes the vision start token + one image token per visual token +
the vision end token (the model config's ``vision_start_token_id``, ``image_token_id``,
``vision_end_token_id``), so its cost (tokens and vision patches) is exact, and the geometry odb
counts with is the processor's own.

:class:`VisionSpec` holds all of it as plain values (the processor as its class name and JSON), so
it pickles into DataLoader workers, which build the processor on first use; the export writes that
same processor (:mod:`odb.training.export`). A model that takes videos carries its video
processor's settings too (``VisionSpec.video``, :mod:`odb.data.videos`). (The rotary positions of
packed multimodal rows are the model's business: odb/training/model/mrope.py.)
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from odb.data.videos import VideoSpec, video_spec_for

__all__ = ["IMAGE_PAD", "ImageProcessor", "VisionSpec", "expand_placeholders", "vision_spec_for"]

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
_GEOMETRY = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
             ("merge_size", "spatial_merge_size"))  # the processor's name, the vision tower's name


@dataclass(frozen=True)
class VisionSpec:
    """A model's image processor and the geometry odb counts visual tokens with.

    Built by :func:`vision_spec_for` (:func:`odb.training.model.build.vision_spec` for a run). Built by
    hand (tests), with ``processor_config`` empty, it stands for transformers' Qwen2-VL image
    processor with the fields below, odb's behaviour before it read the model's own.

    Attributes:
        min_pixels / max_pixels: the pixel bounds an image is resized within.
        patch_size / temporal_patch_size / merge_size: the processor's (= the vision tower's).
        processor_class: the transformers image processor class (e.g. ``Qwen2VLImageProcessorPil``).
        processor_config: its settings as JSON (``to_json_string``), pixel bounds applied.
        image_token_id / vision_start_token_id / vision_end_token_id / video_token_id: the model
            config's, where known (None: the Qwen names ``<|image_pad|>`` etc.).
        video: the model's video processor (:mod:`odb.data.videos`); None where it takes no video.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    processor_class: str = "Qwen2VLImageProcessorPil"
    processor_config: str = ""
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    video_token_id: int | None = None
    video: VideoSpec | None = None

    def build(self):
        """The transformers image processor this spec stands for (a new one)."""
        from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

        cls = get_image_processor_class_from_name(self.processor_class)
        if cls is None:
            raise ValueError(f"transformers {_version()} has no image processor class {self.processor_class!r}")
        if self.processor_config:
            return cls.from_dict(json.loads(self.processor_config))
        return cls(min_pixels=self.min_pixels, max_pixels=self.max_pixels, patch_size=self.patch_size,
                   temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size)

    def visual_tokens(self, grid: torch.Tensor) -> int:
        """How many visual tokens an image of ``image_grid_thw`` row ``grid`` becomes."""
        return int(grid.prod()) // (self.merge_size * self.merge_size)


class ImageProcessor:
    """PIL images -> ``pixel_values [patches, C*T*P*P]`` and ``image_grid_thw [images, 3]``."""

    def __init__(self, spec: VisionSpec) -> None:
        self.spec = spec
        self.processor = spec.build()

    def __call__(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def vision_spec_for(config, source: str | Path | None = None, *, min_pixels: int | None = None,
                    max_pixels: int | None = None, video: dict[str, Any] | None = None) -> VisionSpec | None:
    """The image processor of a vision-language model, as a :class:`VisionSpec`.

    Args:
        config: the model's transformers config; None is returned where it has no ``vision_config``.
        source: the model: a folder (its ``preprocessor_config.json`` is read with
            ``AutoImageProcessor``), or a config JSON / None (random init: the processor class
            transformers maps ``config.model_type`` to, with its defaults and the vision tower's
            patch, temporal patch and merge sizes).
        min_pixels / max_pixels: override the processor's pixel bounds; None keeps its own.
        video: overrides of the video processor's settings (:func:`odb.data.videos.video_spec_for`).

    Raises:
        ValueError: the processor's geometry differs from the vision tower's, the bounds are
            inverted, or transformers knows no image processor for the model type; each names the fix.
    """
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    folder = Path(source) if source is not None and Path(source).is_dir() else None
    processor = _folder_processor(folder) if folder is not None else None
    if processor is None:
        processor = _family_processor(config, folder)
    processor = _with_bounds(processor, min_pixels, max_pixels)
    for own, tower in _GEOMETRY:
        if hasattr(vision, tower) and getattr(processor, own) != getattr(vision, tower):
            raise ValueError(f"the image processor of {folder or config.model_type} has {own} "
                             f"{getattr(processor, own)} but the model's vision tower has {tower} "
                             f"{getattr(vision, tower)}: fix the model's preprocessor_config.json (or its config)")
    size = processor.size
    ids = {name: getattr(config, name, None) for name in ("image_token_id", "vision_start_token_id",
                                                          "vision_end_token_id", "video_token_id")}
    return VisionSpec(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
                      patch_size=processor.patch_size, temporal_patch_size=processor.temporal_patch_size,
                      merge_size=processor.merge_size, processor_class=type(processor).__name__,
                      processor_config=processor.to_json_string(),
                      video=video_spec_for(config, folder, **(video or {})), **ids)


def _folder_processor(folder: Path):
    """The folder's own image processor, or None (with a warning) where it has no processor config."""
    from transformers import AutoImageProcessor

    if not any((folder / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        warnings.warn(f"{folder} has no preprocessor_config.json: its images are processed with transformers' "
                      "defaults for the model type (mean, std, resampling), which may not be the model's; copy "
                      "the base model's preprocessor_config.json into the folder", stacklevel=3)
        return None
    return AutoImageProcessor.from_pretrained(str(folder))


def _family_processor(config, folder: Path | None):
    """The image processor class transformers maps ``config.model_type`` to (torchvision's where
    installed, as ``AutoImageProcessor`` picks), with its defaults and the vision tower's geometry."""
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )
    from transformers.utils import is_torchvision_available

    backends = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if not backends:
        raise ValueError(f"transformers {_version()} maps model type {config.model_type!r} to no image processor; "
                         "train from a model folder that has its preprocessor_config.json")
    order = ("torchvision", "pil") if is_torchvision_available() else ("pil",)
    name = next((backends[b] for b in order if backends.get(b)), None)
    cls = get_image_processor_class_from_name(name) if name else None
    if cls is None:
        raise ValueError(f"no usable image processor for {config.model_type!r} among {backends}: install pillow "
                         "(or torchvision)")
    vision = config.vision_config
    return cls(**{own: getattr(vision, tower) for own, tower in _GEOMETRY if hasattr(vision, tower)})


def _with_bounds(processor, min_pixels: int | None, max_pixels: int | None):
    """``processor``, or a copy resized within other pixel bounds."""
    size = dict(processor.size)
    low = size["shortest_edge"] if min_pixels is None else min_pixels
    high = size["longest_edge"] if max_pixels is None else max_pixels
    if low > high:
        raise ValueError(f"need min_pixels <= max_pixels, got {low} > {high} (the data config's min_pixels / "
                         f"max_pixels, None: the model's own {size['shortest_edge']} / {size['longest_edge']})")
    if (low, high) == (size["shortest_edge"], size["longest_edge"]):
        return processor
    settings: dict[str, Any] = {k: v for k, v in processor.to_dict().items() if k not in ("min_pixels", "max_pixels")}
    settings["size"] = {"shortest_edge": low, "longest_edge": high}
    return type(processor).from_dict(settings)


def _version() -> str:
    import transformers

    return transformers.__version__


def expand_placeholders(text: str, grids: list[torch.Tensor], merge_size: int, placeholder: str,
                        tokens: tuple[str, str, str] = (VISION_START, IMAGE_PAD, VISION_END)) -> str:
    """Each ``placeholder`` (in order) -> its image's visual tokens: ``tokens`` are the vision
    start, image and vision end tokens."""
    start, pad, end = tokens
    pieces = text.split(placeholder)
    out = [pieces[0]]
    for piece, grid in zip(pieces[1:], grids, strict=True):
        count = int(grid.prod()) // (merge_size * merge_size)
        out.append(start + pad * count + end + piece)
    return "".join(out)
