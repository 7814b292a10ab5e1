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

Preference pairs (``pairs=True``, every record a preference record: :mod:`odb.data.preference`):
each of chosen and rejected is rendered as the whole conversation, the prompt then that answer, and
labelled as ``train_on`` 'last' labels it (the final assistant turn: its answer and end-of-turn
token), whatever ``DataConfig.train_on`` says; ``system_message`` and ``chat_template_kwargs``
apply as above. The pair is one sample, one packing unit for the batcher (:func:`sample_sizes`
counts both sequences, and the rejected's tokens apart: the batcher prices a pair's attention and
pads it as two sequences), its two sequences end to end::

    input_ids  [ chosen: prompt | answer ][ rejected: prompt | answer ]
    labels     [ -100 ...       | answer ][ -100 ...         | answer ]
    pair       (len(chosen), len(rejected))

:func:`odb.data.preference.pair_sequences` splits it again. A pair over ``truncate_to`` tokens in all
is cut at the ends of its answers, the longer first, never in a prompt
(:func:`odb.data.preference.pair_answer_tokens`; ``DataConfig.truncation`` does not apply); one
whose prompts and one answer token each do not fit is ``over_cap``. Both sequences carry the
prompt's images and videos: ``pixel_values`` (``image_grid_thw``, ...) hold them twice, chosen's
then rejected's, and ``patches`` counts both. Augmentation is refused for pairs: a pair's reference
log-probs must be the same every epoch. Where those are the records' own (``reference``:
``--reference data``), a pair without them is ``no_reference`` and one over ``truncate_to`` is
``over_cap``, never cut. A preference record read as SFT (``pairs=False``) is skipped,
never trained on its prompt alone (``preference_record``; ``no_messages`` where it has no prompt turns).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from odb.batching.cost import count_label_tokens
from odb.batching.feed import Sizes
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
from odb.data.preference import PAIR_KEYS, is_preference, pair_answer_tokens, split_pair
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
        pairs: every record is a preference record, and every sample a pair (the module docstring):
            ``pair``, ``(len(chosen), len(rejected))``, with both sequences end to end in
            ``input_ids`` and ``labels``.
        reference: (pairs) each pair's reference log-probs are its record's ``ref_chosen_logps`` /
            ``ref_rejected_logps`` (``--reference data``): a record without them is ``no_reference``,
            and a pair over ``truncate_to`` is ``over_cap`` (they score the whole answers, and a cut
            pair would train against the log-probs of tokens it no longer has).
    """

    def __init__(self, path: str | Path, tokenizer, config: DataConfig = DataConfig(), *, seed: int = 0,
                 max_samples: int | None = None, truncate_to: int | None = None,
                 vision: VisionSpec | None = None, indices: Sequence[int] | None = None,
                 cache_dir: str | Path | None = None, streaming: bool = False, pairs: bool = False,
                 reference: bool = False) -> None:
        if streaming and (indices is not None or max_samples):
            raise ValueError("a streaming source has no record numbers: no indices or max_samples")
        for option, off in (("turn_sampling", "false"), ("system_prompt_prob", "0")):
            if pairs and getattr(config, option):
                raise ValueError(f"{option} (augmentation) is not for preference pairs: a pair's reference log-probs "
                                 f"must not change with the epoch; set {option} to {off} in the data config")
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
        self.pairs, self.reference = pairs, reference
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
        if self.pairs:
            return self._process_pair(uid, index, value)
        if is_preference(value):
            self._refuse_preference(value)
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
        chat, input_ids, keep = self._encode(sample, messages, conversation.tools, self.config.train_on)
        labels = torch.where(keep, input_ids, torch.full_like(input_ids, -100))
        if self.truncate_to is not None and len(input_ids) > self.truncate_to:
            kept = self._cut(sample, input_ids, chat)
            input_ids, labels = input_ids[:kept], labels[:kept]
        if not bool((labels != -100).any()):
            raise SkipSample("no_labels", self._no_labels(chat, keep))
        sample.update(input_ids=input_ids, labels=labels)
        return sample

    def _encode(self, sample: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                train_on: str) -> tuple[LabelledChat, torch.Tensor, torch.Tensor]:
        """The chat, its tokens and where its labels are (no image's or video's token), checked
        against the visual tokens of ``sample``'s images and videos."""
        try:
            chat = encode_chat(self.tokenizer, messages, train_on, tools=tools,
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
        return chat, input_ids, keep

    def _process_pair(self, uid: int, index: int, value: dict[str, Any]) -> dict[str, Any]:
        """A preference record as a pair sample (the module docstring)."""
        pair = split_pair(value, self.config.format, text_only=self.vision is None)
        if pair.videos and self.video_pad is None:
            raise SkipSample("video_not_supported", f"{len(pair.videos)} video(s) for a model that takes none here: "
                             f"{self.no_video}")
        prompt, answers = pair.prompt, [pair.chosen, pair.rejected]
        if self.config.system_message == "fold":  # (folded apart as together: an answer opens with its own turn)
            prompt, answers = fold_system_messages(prompt), [fold_system_messages(a) for a in answers]
        sample: dict[str, Any] = {"uid": uid, "index": index, "source": 0, "patches": 0, "truncated_tokens": 0}
        if pair.images:
            prompt = self._add_images(sample, prompt, pair.images)
        if pair.videos:
            prompt = self._add_videos(sample, prompt, [self._load_video(video) for video in pair.videos])
        ids, labels = [], []
        for name, answer in zip(PAIR_KEYS, answers):
            _, input_ids, keep = self._encode(sample, prompt + answer, pair.tools, "last")
            if not bool(keep.any()):
                raise SkipSample("no_labels", f"the chat template marks no token of the {name} answer to train on "
                                 "(odb labels what the template renders for the final assistant turn after its "
                                 "generation prompt); check that the template renders the assistant turns")
            ids.append(input_ids)
            labels.append(torch.where(keep, input_ids, torch.full_like(input_ids, -100)))
        reference = [value.get(f"ref_{name}_logps") for name in PAIR_KEYS]  # (TRL's precomputed columns)
        if self.reference and any(v is None for v in reference):
            raise SkipSample("no_reference", "--reference data takes each pair's reference log-probs from its record, "
                             "and this one has no ref_chosen_logps / ref_rejected_logps: give every record both, or "
                             "use --reference precompute (the initial weights' own, computed before the first step)")
        if self.truncate_to is not None and sum(map(len, ids)) > self.truncate_to:
            if self.reference:
                raise SkipSample("over_cap", f"the pair's {sum(map(len, ids))} tokens would be cut to max_tokens "
                                 f"{self.truncate_to}, and its record's ref_chosen_logps / ref_rejected_logps score "
                                 "the whole answers (--reference data): raise max_tokens, or use --reference "
                                 "precompute, which scores each pair as it is trained")
            prompts = [int((label != -100).nonzero()[0]) for label in labels]  # the tokens before the first label
            kept = pair_answer_tokens((prompts[0], prompts[1]), (len(ids[0]), len(ids[1])), self.truncate_to)
            sample["truncated_tokens"] = sum(map(len, ids)) - sum(prompts) - sum(kept)
            ids = [sequence[:prompt + keep] for sequence, prompt, keep in zip(ids, prompts, kept)]
            labels = [sequence[:prompt + keep] for sequence, prompt, keep in zip(labels, prompts, kept)]
        for kind in MEDIA:  # both sequences carry the prompt's images and videos: chosen's, then rejected's
            for key in kind.keys:
                if key in sample:
                    sample[key] = torch.cat([sample[key], sample[key]])
        sample.update(input_ids=torch.cat(ids), labels=torch.cat(labels), pair=(len(ids[0]), len(ids[1])),
                      patches=2 * sample["patches"])
        if any(v is not None for v in reference):
            if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v <= 0
                       for v in reference):
                raise SkipSample("bad_content", f"ref_chosen_logps / ref_rejected_logps must both be log-probabilities "
                                 f"(finite numbers <= 0), got {reference}")
            sample["ref_logps"] = (float(reference[0]), float(reference[1]))
        margin = value.get("margin")  # (TRL's reward margin: a reward model's loss subtracts it)
        if margin is not None:
            if not (isinstance(margin, int | float) and not isinstance(margin, bool) and math.isfinite(margin)):
                raise SkipSample("bad_content", f"'margin' must be a finite number, got {margin!r:.40}")
            sample["margin"] = float(margin)
        return sample

    def _refuse_preference(self, value: dict[str, Any]) -> None:
        """Skips a preference record read as a next-token (SFT) sample: it would train the prompt's own
        turns (or nothing) and neither answer."""
        fix = "train it with a preference objective (--objective, e.g. DPO), or give SFT records (messages)"
        if any(value.get(key) is not None for key in ("messages", "conversations")):
            raise SkipSample("preference_record", f"a preference record ('chosen', 'rejected') whose 'messages' or "
                             f"'conversations' are its prompt: as SFT it would train the prompt alone; {fix}")
        raise SkipSample("no_messages", f"a record needs 'messages' or 'conversations'; this is a preference record "
                         f"('chosen', 'rejected'): {fix}")

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


def sample_sizes(sample: dict[str, Any]) -> Sizes:
    """A processed sample's tokens, label tokens and vision patches, for the batcher, and a pair's
    rejected tokens (``second``: the batcher prices and pads a pair as its two sequences)."""
    second = int(sample["pair"][1]) if "pair" in sample else 0
    return Sizes(len(sample["input_ids"]), count_label_tokens(sample["labels"].tolist()),
                 int(sample.get("patches", 0)), second=second)

