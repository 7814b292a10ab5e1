"""A processed sample's images and videos: loading them, their tokens in the text, and cutting them.

:class:`MediaSamples` is the part of :class:`odb.data.processing.SampleDataset` that handles
visual inputs (its attributes: ``vision``, ``tokenizer``, ``image_folder``, ``vision_tokens``,
``vision_ids``, ``image_pad_id``, ``video_pad``, ``video_pad_id``): images through the model's own image processor
(:mod:`odb.data.images`), videos read, sampled and processed as the model's video processor does
(:mod:`odb.data.videos`), each laid out in the text as the family's processor lays it out; the
checks that a tokenized sample holds exactly their visual tokens; which tokens are never labels;
and the images and videos a cut between turns drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from odb.data.formats import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, SkipSample, text_of
from odb.data.images import IMAGE_PAD, VISION_END, VISION_START, ImageProcessor, VisionSpec, expand_placeholders
from odb.data.video_decode import read_video
from odb.data.videos import Video, expand_video, process_video

__all__ = ["MEDIA", "Media", "MediaSamples", "video_token", "vision_tokens"]


class MediaSamples:
    """The visual half of :class:`odb.data.processing.SampleDataset` (the module docstring)."""

    vision: VisionSpec | None
    _images: ImageProcessor | None

    def _drop_after(self, sample: dict[str, Any], input_ids: torch.Tensor, kept: int, kind: Media) -> None:
        """Drops the images (or videos: ``kind``) whose visual tokens all lie at or after token
        ``kept`` (an end of turn, which never falls inside one): their rows of the sample's tensors."""
        grids = sample.get(kind.grids)
        if grids is None:
            return
        assert self.vision is not None
        visual_tokens = (grids.prod(dim=1) // self.vision.merge_size ** 2).tolist()
        kept_tokens = int((input_ids[:kept] == getattr(self, kind.pad_id)).sum())
        boundaries = list(accumulate(visual_tokens, initial=0))
        assert kept_tokens in boundaries, f"a cut between turns fell inside {kind.name}"
        count = boundaries.index(kept_tokens)
        if count == len(visual_tokens):
            return
        patches = int(grids[:count].prod(dim=1).sum())
        for key in kind.keys:
            if key in sample:
                if count == 0:
                    del sample[key]
                else:
                    sample[key] = sample[key][:patches if key == kind.pixels else count]

    def _check_image_tokens(self, input_ids: torch.Tensor, grids: torch.Tensor | None,
                            video_grids: torch.Tensor | None = None) -> None:
        """Raises ``image_token_mismatch`` unless the tokenized sample holds exactly its images' and
        videos' visual tokens (a model that takes no video: no video token): a literal image or video
        token in a record's text (or one a chat template adds) would stop the model's forward on
        every rank, at the M-RoPE step."""
        assert self.vision is not None
        video = self.video_pad_id if self.video_pad_id is not None else self.vision.video_token_id
        if video == self.image_pad_id:
            video = None
        for name, token_id, found_grids in (("image", self.image_pad_id, grids), ("video", video, video_grids)):
            if token_id is None:
                continue
            expected = sum(self.vision.visual_tokens(grid) for grid in found_grids) if found_grids is not None else 0
            found = int((input_ids == token_id).sum())
            if found != expected:
                spelled = self.tokenizer.convert_ids_to_tokens(token_id)
                raise SkipSample("image_token_mismatch", (
                    f"{found} {name} token(s) {spelled!r} in the tokenized sample but its "
                    f"{0 if found_grids is None else len(found_grids)} {name}(s) make {expected}; the record's text "
                    "holds the model's image or video token literally (or the chat template adds one): remove it, "
                    "or write images as <image> placeholders (videos as <video>) or content parts"))

    def _media_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where the sample's images and videos are: their visual tokens and, around them, the vision
        start and end tokens and what lies between (Qwen3-VL's group times), pair by pair (nested:
        Qwen3-VL's groups sit inside their video's outer pair)."""
        pads = [i for i in (self.image_pad_id, self.video_pad_id) if i is not None]
        media = torch.isin(input_ids, torch.tensor(pads))
        if not bool(media.any()):  # no image or video: nothing around them to find
            return media
        start, _, end = self.vision_ids
        ids, opened = input_ids.tolist(), []
        for at, token in enumerate(ids):
            if token == start:
                opened.append(at)
            elif token == end and opened:
                first = opened.pop()
                if not opened and bool(media[first:at].any()):  # an outermost pair around visual tokens
                    media[first:at + 1] = True
        return media

    def _add_images(self, sample: dict[str, Any], messages: list[dict[str, Any]], paths: list[str]
                    ) -> list[dict[str, Any]]:
        """Each ``<image>`` placeholder -> its image's tokens; the images' tensors into ``sample``."""
        assert self.vision is not None
        pixel_values, grids = self._load_images(paths)
        grid_list, expanded = list(grids), []
        for message in messages:
            count = text_of(message).count(IMAGE_PLACEHOLDER)
            if count:
                message = {**message, "content": expand_placeholders(
                    message["content"], grid_list[:count], self.vision.merge_size, IMAGE_PLACEHOLDER,
                    self.vision_tokens)}
            grid_list = grid_list[count:]
            expanded.append(message)
        sample.update(pixel_values=pixel_values, image_grid_thw=grids, patches=int(grids.prod(dim=1).sum()))
        return expanded

    def _add_videos(self, sample: dict[str, Any], messages: list[dict[str, Any]], videos: list[Video]
                    ) -> list[dict[str, Any]]:
        """Each ``<video>`` placeholder -> its video's tokens; the videos' tensors into ``sample``."""
        assert self.vision is not None and self.vision.video is not None and self.video_pad is not None
        tokens = (self.vision_tokens[0], self.video_pad, self.vision_tokens[2])
        queue = iter(videos)
        expanded = []
        for message in messages:
            if VIDEO_PLACEHOLDER in text_of(message):
                pieces = message["content"].split(VIDEO_PLACEHOLDER)
                text = pieces[0] + "".join(expand_video(next(queue), self.vision.video, tokens) + piece
                                           for piece in pieces[1:])
                message = {**message, "content": text}
            expanded.append(message)
        grids = torch.stack([video.grid for video in videos])
        sample.update(pixel_values_videos=torch.cat([video.pixel_values for video in videos]), video_grid_thw=grids,
                      patches=sample["patches"] + int(grids.prod(dim=1).sum()))
        if self.vision.video.seconds:
            sample["second_per_grid_ts"] = torch.tensor([video.second_per_grid for video in videos])
        return expanded

    def _load_video(self, video: dict[str, Any]) -> Video:
        source = video["video"]
        path = [self._path(name) for name in source] if isinstance(source, list) else self._path(source)
        assert self.vision is not None and self.vision.video is not None
        try:
            return process_video(read_video(path, self.vision.video, video.get("fps")), self.vision.video)
        except FileNotFoundError as err:
            raise SkipSample("missing_video", str(err)) from None
        except (ValueError, OSError) as err:
            raise SkipSample("unreadable_video", f"{source}: {err}") from None

    def _load_images(self, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image, UnidentifiedImageError

        images = []
        for name in paths:
            path = self._path(name)
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

    def _path(self, name: str) -> Path:
        """A record's image or video path: as it is where absolute, else under ``image_folder``."""
        return Path(name) if Path(name).is_absolute() else self.image_folder / name


@dataclass(frozen=True)
class Media:
    """Where a sample keeps one kind of visual input."""

    name: str
    pad_id: str  # the SampleDataset attribute holding its token id
    grids: str
    pixels: str
    keys: tuple[str, ...]


MEDIA = (Media("an image", "image_pad_id", "image_grid_thw", "pixel_values", ("pixel_values", "image_grid_thw")),
         Media("a video", "video_pad_id", "video_grid_thw", "pixel_values_videos",
               ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")))


def video_token(tokenizer, vision: VisionSpec) -> tuple[str | None, str]:
    """The video token as the tokenizer spells it (the model config's ``video_token_id``), or None
    and why the model takes no video here (the reason a record with a video is skipped)."""
    if vision.video is None:
        return None, "odb knows no video processor for its model type (Qwen2-VL, Qwen2.5-VL and Qwen3-VL take videos)"
    token_id = vision.video_token_id
    name = tokenizer.convert_ids_to_tokens(token_id) if token_id is not None else None
    if token_id is None or name is None or token_id in (vision.image_token_id, tokenizer.unk_token_id) or \
            tokenizer.convert_tokens_to_ids(name) != token_id:
        return None, (f"its video token (video_token_id {token_id}) is not a token of its own in the tokenizer "
                      f"(which spells it {name!r}; the image token is {vision.image_token_id}): use the model's own "
                      "tokenizer (--tokenizer), which has <|video_pad|>")
    return name, ""


def vision_tokens(tokenizer, vision: VisionSpec) -> tuple[str, str, str]:
    """The vision start, image and vision end tokens: the model config's ids, as the tokenizer
    spells them (the Qwen names where the spec has no ids)."""
    ids = (vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id)
    if any(i is None for i in ids):
        names = (VISION_START, IMAGE_PAD, VISION_END)
        ids = tuple(tokenizer.convert_tokens_to_ids(name) for name in names)
    else:
        names = tuple(tokenizer.convert_ids_to_tokens(list(ids)))
    unknown = [name for name, token_id in zip(names, ids)
               if token_id is None or token_id == tokenizer.unk_token_id or name is None
               or tokenizer.convert_tokens_to_ids(name) != token_id]
    if unknown:
        raise ValueError(f"the tokenizer does not know the model's vision tokens {unknown} (ids {list(ids)}): "
                         "use the model's own tokenizer (--tokenizer)")
    return names
