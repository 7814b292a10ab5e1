"""Samples processed in DataLoader workers: records -> chat template -> tokens, labels, images.

The true cost of a sample (tokens after templating, augmentation and image -> visual-token
expansion; vision patches) is known only here; the batcher sees it through :func:`sample_sizes`.
A record that cannot be a sample is skipped and counted by reason (:data:`SKIP_REASONS`); with
``strict`` it stops the run with its file, line and reason instead, on every rank. A text model
(``vision=None``) skips records with images (``image_for_text_model``) rather than training on
their text alone, and reads ``<image>`` as text.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from odb.batching.config import load_json_config
from odb.batching.cost import count_label_tokens
from odb.data.formats import FORMATS, IMAGE_PLACEHOLDER, SkipSample, normalize
from odb.data.images import IMAGE_PAD, ImageProcessor, VisionSpec, expand_placeholders
from odb.data.sources import Source

__all__ = ["SKIP_REASONS", "DataConfig", "SampleDataset", "load_data_config", "sample_sizes"]

SKIP_REASONS = ("not_json", "not_an_object", "no_messages", "bad_role", "bad_content", "empty_content",
                "no_assistant_turn", "image_placeholder_mismatch", "mixed_image_sources", "image_for_text_model",
                "missing_image", "unreadable_image", "over_cap", "error")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How records become samples (``configs/data.json``, ``--data_config``)."""

    format: str = "auto"
    """'auto' (per record), 'messages', 'sharegpt' or 'llava'."""
    train_on: str = "assistant"
    """'assistant': labels on assistant turns only; 'all': every text token."""
    strict: bool = False
    """Stop at the first bad record (file, line, reason) instead of skipping and counting it."""
    system_prompts: tuple[str, ...] = ()
    """Augmentation: with probability system_prompt_prob, a random one of these as system turn."""
    system_prompt_prob: float = 0.0
    turn_sampling: bool = False
    """Augmentation: keep a random number (>= 1) of the leading user/assistant exchanges."""
    image_folder: str | None = None
    """Where relative image paths start (default: the data file's folder)."""
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data format must be one of {FORMATS}, got {self.format!r}")
        if self.train_on not in ("assistant", "all"):
            raise ValueError(f"train_on must be 'assistant' or 'all', got {self.train_on!r}")
        if not 0.0 <= self.system_prompt_prob <= 1.0:
            raise ValueError("system_prompt_prob must be within [0, 1]")
        if self.system_prompt_prob and not self.system_prompts:
            raise ValueError("system_prompt_prob > 0 needs system_prompts to choose from")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("need 0 < min_pixels <= max_pixels")
        object.__setattr__(self, "system_prompts", tuple(self.system_prompts))


def load_data_config(path: str | Path | None, **overrides: Any) -> DataConfig:
    known = [f.name for f in dataclasses.fields(DataConfig)]
    values = load_json_config(path, known=known, what="data config",
                              fix="pass --data_config configs/data.json") if path else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return DataConfig(**values)


class SampleDataset(Dataset):
    """Processed samples, indexed by uid (``epoch * len + index``; the epoch seeds augmentation).

    A sample: ``uid``, ``index``, ``input_ids``, ``labels`` and, with images, ``pixel_values``,
    ``image_grid_thw`` and ``patches``. A record that is skipped: ``{"uid", "skip": reason,
    "where": "file:line", "fatal": strict}``. ``vision`` is the image geometry of a vision-language
    model (:func:`odb.training.model.vision_spec`); None means a text model, which takes no images.
    """

    def __init__(self, path: str | Path, tokenizer, config: DataConfig = DataConfig(), *, seed: int = 0,
                 max_samples: int | None = None, truncate_to: int | None = None,
                 vision: VisionSpec | None = None) -> None:
        self.source = Source(path)
        self.size = min(len(self.source), max_samples) if max_samples else len(self.source)
        self.tokenizer, self.config, self.seed, self.truncate_to = tokenizer, config, seed, truncate_to
        root = Path(path) if Path(path).is_dir() else Path(path).parent
        self.image_folder = Path(config.image_folder) if config.image_folder else root
        self.vision = vision
        self._images: ImageProcessor | None = None  # built in the worker on first use
        self.image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD) if vision is not None else None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, uid: int) -> dict[str, Any]:
        index = uid % self.size
        record = self.source.get(index)
        try:
            if record.value is None:
                raise SkipSample(record.error or "error")
            return self._process(uid, index, record.value)
        except SkipSample as skip:
            return {"uid": uid, "index": index, "skip": skip.reason, "where": record.where,
                    "detail": str(skip), "fatal": self.config.strict}
        except Exception as err:  # noqa: BLE001 - a worker must not die on one record
            return {"uid": uid, "index": index, "skip": "error", "where": record.where,
                    "detail": f"{type(err).__name__}: {err}", "fatal": self.config.strict}

    def _process(self, uid: int, index: int, value: dict[str, Any]) -> dict[str, Any]:
        conversation = normalize(value, self.config.format, text_only=self.vision is None)
        messages, images = self._augment_with_images(conversation, random.Random(self.seed * 1_000_003 + uid))
        sample: dict[str, Any] = {"uid": uid, "index": index, "patches": 0}
        if images:
            assert self.vision is not None, "normalize(text_only=True) lets no image through"
            pixel_values, grids = self._load_images(images)
            grid_list = list(grids)
            expanded = []
            for message in messages:
                count = message["content"].count(IMAGE_PLACEHOLDER)
                content = expand_placeholders(message["content"], grid_list[:count], self.vision.merge_size,
                                              IMAGE_PLACEHOLDER)
                grid_list = grid_list[count:]
                expanded.append({**message, "content": content})
            messages = expanded
            sample.update(pixel_values=pixel_values, image_grid_thw=grids, patches=int(grids.prod(dim=1).sum()))
        encoded = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
        input_ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
        if self.config.train_on == "assistant":
            keep = torch.tensor(encoded["assistant_masks"], dtype=torch.bool)
        else:
            keep = torch.ones_like(input_ids, dtype=torch.bool)
        if self.image_pad_id is not None:
            keep &= input_ids != self.image_pad_id
        labels = torch.where(keep, input_ids, torch.full_like(input_ids, -100))
        if self.truncate_to is not None and len(input_ids) > self.truncate_to:
            if images and bool((input_ids[self.truncate_to:] == self.image_pad_id).any()):
                raise SkipSample("over_cap", f"{len(input_ids)} tokens; cutting at {self.truncate_to} "
                                 "would cut an image")
            input_ids, labels = input_ids[:self.truncate_to], labels[:self.truncate_to]
        sample.update(input_ids=input_ids, labels=labels)
        return sample

    def _augment_with_images(self, conversation, rng: random.Random) -> tuple[list[dict[str, str]], list[str]]:
        """The augmented messages and the images of their ``<image>`` placeholders, in order: a
        turn that augmentation leaves out takes its images with it."""
        owned, at = [], 0
        for message in conversation.messages:
            count = message["content"].count(IMAGE_PLACEHOLDER) if conversation.images else 0
            owned.append((message, conversation.images[at:at + count]))
            at += count
        by_message = {id(message): paths for message, paths in owned}
        messages = self._augment([m for m, _ in owned], rng)
        return messages, [p for m in messages for p in by_message.get(id(m), [])]

    def _augment(self, messages: list[dict[str, str]], rng: random.Random) -> list[dict[str, str]]:
        config = self.config
        if config.turn_sampling:
            assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            messages = messages[:rng.choice(assistant_at) + 1]
        if config.system_prompt_prob and rng.random() < config.system_prompt_prob:
            system = {"role": "system", "content": rng.choice(config.system_prompts)}
            messages = [system] + [m for m in messages if m["role"] != "system"]
        return messages

    def _load_images(self, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image, UnidentifiedImageError

        images = []
        for name in paths:
            path = Path(name) if Path(name).is_absolute() else self.image_folder / name
            if not path.is_file():
                raise SkipSample("missing_image", str(path))
            try:
                with Image.open(path) as image:
                    images.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError) as err:
                raise SkipSample("unreadable_image", f"{path}: {err}") from None
        if self._images is None:
            self._images = ImageProcessor(self.vision)
        return self._images(images)


def sample_sizes(sample: dict[str, Any]) -> tuple[int, int, int]:
    """``(tokens, label_tokens, vision_patches)`` of a processed sample, for the batcher."""
    return (len(sample["input_ids"]), count_label_tokens(sample["labels"].tolist()), int(sample.get("patches", 0)))

