"""Samples processed in DataLoader workers: records -> chat template -> tokens, labels, images.

The true cost of a sample (tokens after templating, augmentation and image -> visual-token
expansion; vision patches) is known only here; the batcher sees it through :func:`sample_sizes`.
A record that cannot be a sample is skipped and counted by reason (:data:`odb.data.formats.SKIP_REASONS`); with
``strict`` it stops the run with its file, line and reason instead, on every rank. A text model
(``vision=None``) skips records with images (``image_for_text_model``) or videos
(``video_not_supported``) rather than training on their text alone, and reads ``<image>`` as text.
Videos (:mod:`odb.data.videos`) are read, sampled and processed here too, as the model's own video
processor does (the visual half of a sample: :mod:`odb.data.media`).

Labels come from :mod:`odb.data.labels`, which finds the assistant turns (their tool calls and
reasoning too) with any chat template (``DataConfig.train_on``); a record's ``tools`` reach the
template, and ``DataConfig.chat_template_kwargs`` reach every rendering. Under
``DataConfig.system_message`` 'fold' each system message's text opens the user turn after it
(:func:`odb.data.formats.fold_system_messages`, after augmentation), for templates that refuse or
drop a system message. A template that rewrites past turns is skipped per record as
``template_mismatch`` (the detail says where the renderings part and names the fallback:
``train_on`` 'last' or 'all', or ``system_message`` 'fold' where the template drops, moves or
refuses the system message); a sample left with no label token (template, ``train_on`` or
truncation) as ``no_labels``: it would cost a slot and teach nothing. An image's or a video's
tokens (with their vision start and end tokens and, for Qwen3-VL, the group times between) are
never labels. For a vision-language model, a tokenized sample must hold exactly its images' and
videos' visual tokens (the model's image and video tokens, counted): a literal ``<|image_pad|>``
in a record's text would stop the model's forward on every rank, so it is that record's
``image_token_mismatch`` (a video's too).

Truncation (only with ``truncate_to``, the run's over_cap policy 'truncate'): under
``DataConfig.truncation`` 'turns' a long sample keeps its longest run of leading tokens that ends
at the end of an assistant turn and fits, and the images and videos of the turns it drops go with
them (their ``pixel_values`` / ``pixel_values_videos`` and grid rows, ``patches``); if even the
first assistant turn does not fit, or under 'tokens', it is cut at ``truncate_to`` tokens, unless
that would cut an image or a video (``over_cap``). Every sample carries ``truncated_tokens``, the
tokens cut (0 when none), which :class:`odb.data.feed.SampleFeed` counts.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from odb.batching.cost import count_label_tokens
from odb.data.config import TRUNCATION, DataConfig, load_data_config
from odb.data.formats import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    SkipSample,
    fold_system_messages,
    normalize,
    text_of,
)
from odb.data.images import ImageProcessor, VisionSpec
from odb.data.labels import LabelledChat, TemplateDropsFields, TemplateMismatch, encode_chat
from odb.data.media import MEDIA, MediaSamples, video_token, vision_tokens
from odb.data.sources import Source
from odb.data.streaming import StreamShards

__all__ = ["TRUNCATION", "DataConfig", "SampleDataset", "load_data_config", "sample_sizes"]

class SampleDataset(MediaSamples, Dataset):
    """Processed samples, indexed by uid (``epoch * len + index``; the epoch seeds augmentation).

    A sample: ``uid``, ``index``, ``source`` (0: :attr:`source_names`), ``input_ids``, ``labels``,
    ``patches``, ``truncated_tokens`` (the tokens cut to fit ``truncate_to``, 0 when none) and, with
    images, ``pixel_values`` and ``image_grid_thw``. A record that is skipped: ``{"uid", "index",
    "source", "skip": reason, "where":
    "file:line", "detail", "fatal": strict}``. ``vision`` is the image processor of a vision-language
    model (:func:`odb.training.model.build.vision_spec`: the model's own, built in each worker on first
    use); None means a text model, which takes no images.

    Args:
        path: a data file or folder (:class:`odb.data.sources.Source`).
        tokenizer: a fast tokenizer with the model's chat template.
        config: how records become samples.
        seed: seeds augmentation, with the uid.
        max_samples: use only the first this many records (of ``indices``, when given).
        truncate_to: cut longer samples to this many tokens (``config.truncation`` says where); None
            leaves long samples to the batcher (over_cap 'drop' or 'error').
        vision: the image processor and vision tokens of a vision-language model; None for a text model.
        indices: the dataset is these records of the source, in this order (e.g. a validation
            split): ``index`` is the position in ``indices``, ``where`` the record's own file:line.
        cache_dir: where a JSONL file's index goes when the data's folder is read-only
            (:class:`odb.data.sources.Source`).
        streaming: read ``path`` as JSONL and Parquet shards, never indexed (:mod:`odb.data.streaming`): the
            length is then the uid space of one pass, not a record count, and a rank's uids come
            from its :class:`odb.data.streaming.ShardReader`.
    """

    def __init__(self, path: str | Path, tokenizer, config: DataConfig = DataConfig(), *, seed: int = 0,
                 max_samples: int | None = None, truncate_to: int | None = None,
                 vision: VisionSpec | None = None, indices: Sequence[int] | None = None,
                 cache_dir: str | Path | None = None, streaming: bool = False) -> None:
        if streaming and (indices is not None or max_samples):
            raise ValueError("a streaming source has no record numbers: no indices or max_samples")
        self.source = StreamShards(path) if streaming else Source(path, cache_dir=cache_dir)
        if indices is not None:
            indices = [int(i) for i in indices]
            outside = [i for i in indices if not 0 <= i < len(self.source)]
            if not indices or outside:
                raise ValueError(f"indices must be a non-empty list of record numbers in [0, {len(self.source)}) "
                                 f"for {path}, got {len(indices)} of them, {outside[:5]} outside")
        self.indices = indices
        available = len(indices) if indices is not None else len(self.source)
        self.size = min(available, max_samples) if max_samples else available
        self.tokenizer, self.config, self.seed, self.truncate_to = tokenizer, config, seed, truncate_to
        root = Path(path) if Path(path).is_dir() else Path(path).parent
        self.image_folder = Path(config.image_folder) if config.image_folder else root
        self.vision = vision
        self._images: ImageProcessor | None = None  # built in the worker on first use
        self.vision_tokens = vision_tokens(tokenizer, vision) if vision is not None else None
        self.image_pad_id = tokenizer.convert_tokens_to_ids(self.vision_tokens[1]) if vision is not None else None
        self.video_pad, self.no_video = video_token(tokenizer, vision) if vision is not None else (None, "")
        self.video_pad_id = tokenizer.convert_tokens_to_ids(self.video_pad) if self.video_pad is not None else None
        self.vision_ids = tuple(tokenizer.convert_tokens_to_ids(list(self.vision_tokens))) if vision is not None \
            else None  # the vision start, image and vision end token ids

    def __len__(self) -> int:
        return self.size

    source_names: tuple[str, ...] = ("data",)
    """The sources the samples come from (one here; :class:`odb.data.mixture.MixedDataset` has several)."""

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, record)``: which source a dataset index is in, and its record there."""
        return 0, index

    def fingerprint(self) -> str:
        """A short hash of which records this dataset holds (its source's and its indices)."""
        chosen = self.indices[:self.size] if self.indices is not None else self.size
        return hashlib.sha256(json.dumps([self.source.fingerprint(), chosen]).encode()).hexdigest()[:16]

    def __getitem__(self, uid: int) -> dict[str, Any]:
        index = uid % self.size
        record = self.source.get(self.indices[index] if self.indices is not None else index)
        try:
            if record.value is None:
                raise SkipSample(record.error or "error")
            return self._process(uid, index, record.value)
        except SkipSample as skip:
            return {"uid": uid, "index": index, "source": 0, "skip": skip.reason, "where": record.where,
                    "detail": str(skip), "fatal": self.config.strict}
        except Exception as err:  # noqa: BLE001 - a worker must not die on one record
            return {"uid": uid, "index": index, "source": 0, "skip": "error", "where": record.where,
                    "detail": f"{type(err).__name__}: {err}", "fatal": self.config.strict}

    def _process(self, uid: int, index: int, value: dict[str, Any]) -> dict[str, Any]:
        conversation = normalize(value, self.config.format, text_only=self.vision is None)
        if conversation.videos and self.video_pad is None:
            raise SkipSample("video_not_supported", f"{len(conversation.videos)} video(s) for a model that takes "
                             f"none here: {self.no_video}")
        messages, images, videos = self._augment_with_media(conversation, random.Random(self.seed * 1_000_003 + uid))
        if self.config.system_message == "fold":  # (after augmentation: an added system prompt is folded too)
            messages = fold_system_messages(messages)
        sample: dict[str, Any] = {"uid": uid, "index": index, "source": 0, "patches": 0, "truncated_tokens": 0}
        if images:
            assert self.vision is not None, "normalize(text_only=True) lets no image through"
            messages = self._add_images(sample, messages, images)
        if videos:
            messages = self._add_videos(sample, messages, [self._load_video(video) for video in videos])
        try:
            chat = encode_chat(self.tokenizer, messages, self.config.train_on, tools=conversation.tools,
                               template_kwargs=self.config.chat_template_kwargs)
        except TemplateDropsFields as err:
            raise SkipSample("template_drops_fields", str(err)) from None
        except TemplateMismatch as err:
            raise SkipSample("template_mismatch", str(err)) from None
        input_ids = torch.tensor(chat.input_ids, dtype=torch.long)
        if self.vision is not None:
            self._check_image_tokens(input_ids, sample.get("image_grid_thw"), sample.get("video_grid_thw"))
        keep = torch.zeros_like(input_ids, dtype=torch.bool)
        for start, end in chat.label_spans:
            keep[start:end] = True
        if self.vision is not None:  # an image's or a video's tokens are never labels, wherever they are
            keep &= ~self._media_tokens(input_ids)
        labels = torch.where(keep, input_ids, torch.full_like(input_ids, -100))
        if self.truncate_to is not None and len(input_ids) > self.truncate_to:
            kept = self._cut(sample, input_ids, chat)
            input_ids, labels = input_ids[:kept], labels[:kept]
        if not bool((labels != -100).any()):
            raise SkipSample("no_labels", self._no_labels(chat, keep))
        sample.update(input_ids=input_ids, labels=labels)
        return sample

    def _cut(self, sample: dict[str, Any], input_ids: torch.Tensor, chat: LabelledChat) -> int:
        """Where a sample over ``truncate_to`` tokens ends (see the module docstring); records the
        tokens cut in ``sample["truncated_tokens"]`` and drops the images and videos of the turns cut."""
        cap = self.truncate_to
        assert cap is not None and len(input_ids) > cap
        fits = [end for end in chat.turn_ends if end <= cap] if self.config.truncation == "turns" else []
        if fits:
            kept = fits[-1]
            for kind in MEDIA:
                self._drop_after(sample, input_ids, kept, kind)
            sample["patches"] = sum(int(sample[kind.grids].prod(dim=1).sum()) for kind in MEDIA
                                    if kind.grids in sample)
        else:
            kept = cap
            for kind in MEDIA:
                if kind.grids in sample and bool((input_ids[cap:] == getattr(self, kind.pad_id)).any()):
                    raise SkipSample("over_cap", f"{len(input_ids)} tokens; cutting at {cap} would cut {kind.name}")
        sample["truncated_tokens"] = len(input_ids) - kept
        return kept

    def _no_labels(self, chat: LabelledChat, keep: torch.Tensor) -> str:
        """Why a sample has no label token, for the skip's detail."""
        if bool(keep.any()):
            first = int(keep.nonzero()[0])
            return (f"truncation to {self.truncate_to} tokens cut every label token (the first is token {first} "
                    f"of {len(chat.input_ids)}); raise max_tokens, shorten the record, or set over_cap to 'drop'")
        return (f"the chat template marks no token to train on under train_on {self.config.train_on!r} (odb "
                "labels what the template renders for an assistant turn after its generation prompt); check the "
                "template renders the assistant turns, or set train_on to 'all'")

    def _augment_with_media(self, conversation, rng: random.Random
                            ) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
        """The augmented messages and the images and videos of their placeholders, in order: a turn
        that augmentation leaves out takes its images and videos with it."""
        owned, at = [], [0, 0]
        for message in conversation.messages:
            mine = []
            for i, (placeholder, items) in enumerate(((IMAGE_PLACEHOLDER, conversation.images),
                                                      (VIDEO_PLACEHOLDER, conversation.videos))):
                count = text_of(message).count(placeholder) if items else 0
                mine.append(items[at[i]:at[i] + count])
                at[i] += count
            owned.append((message, mine))
        by_message = {id(message): mine for message, mine in owned}
        messages = self._augment([m for m, _ in owned], rng)
        kept = [by_message[id(m)] for m in messages if id(m) in by_message]
        return messages, [p for mine in kept for p in mine[0]], [v for mine in kept for v in mine[1]]

    def _augment(self, messages: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
        config = self.config
        if config.turn_sampling:
            assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            messages = messages[:rng.choice(assistant_at) + 1]
        if config.system_prompt_prob and rng.random() < config.system_prompt_prob:
            system = {"role": "system", "content": rng.choice(config.system_prompts)}
            messages = [system] + [m for m in messages if m["role"] != "system"]
        return messages


def sample_sizes(sample: dict[str, Any]) -> tuple[int, int, int]:
    """``(tokens, label_tokens, vision_patches)`` of a processed sample, for the batcher."""
    return (len(sample["input_ids"]), count_label_tokens(sample["labels"].tolist()), int(sample.get("patches", 0)))

