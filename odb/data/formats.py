"""The conversation formats fine-tuning users have, normalized to one shape.

* ``messages`` (OpenAI / UltraChat / TRL): ``{"messages": [{"role": "user", "content": "..."}, ...]}``;
  content may also be a list of parts: ``{"type": "text", "text": ...}``, an image part carrying
  its path (``{"type": "image", "image": path}``, ``{"type": "image_url", "image_url": {"url":
  path}}``), or ``{"type": "image"}`` with no path (TRL / Hugging Face style: the paths are in a
  top-level ``"images": [...]``, in order). Each image part becomes an ``<image>`` placeholder.
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}``.
* ``llava``: ShareGPT plus ``"image": path`` (or ``"images": [...]``) and ``<image>``
  placeholders in the turns.

Images: a record's top-level ``"images"`` (or ``"image"``) fill its placeholders in order (in any
format: the ``<image>`` of string contents and the image parts without a path), or else its image
parts carry their own paths; a record that does both is skipped (``mixed_image_sources``), as is a
placeholder count that differs from the image count (``image_placeholder_mismatch``). One image and
no placeholder: it goes before the first user turn (LLaVA files sometimes omit it). In a record
without images ``<image>`` is plain text (a user may ask about the HTML tag). For a text model
(``text_only``) a record with images is skipped (``image_for_text_model``), never trained on
without them.

:func:`normalize` returns ``Conversation(messages, images)``, with roles system / user /
assistant and one ``<image>`` placeholder per image, or raises :class:`SkipSample` with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMATS", "IMAGE_PLACEHOLDER", "Conversation", "SkipSample", "detect_format", "normalize"]

IMAGE_PLACEHOLDER = "<image>"
FORMATS = ("auto", "messages", "sharegpt", "llava")
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "model": "assistant", "bot": "assistant"}


class SkipSample(Exception):
    """A record that cannot become a training sample; ``reason`` is a short key for counting."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    images: list[str] = field(default_factory=list)


def detect_format(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "llava" if ("image" in record or "images" in record) else "sharegpt"
    raise SkipSample("no_messages", "a record needs 'messages' or 'conversations'")


def _image_source(part: dict[str, Any]) -> str | None:
    """The path an image part carries, or None when it carries none (TRL style)."""
    source = part.get("image") or part.get("image_url")
    if isinstance(source, dict):
        source = source.get("url")
    if source is not None and not (isinstance(source, str) and source):
        raise SkipSample("bad_content", f"an image part whose path is not a string: {part!r:.60}")
    return source


def _content(value: Any, part_images: list[str | None]) -> str:
    """A turn's text; each image part's path (or None) is appended to ``part_images``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise SkipSample("bad_content", f"a text part whose text is not a string: {part!r:.60}")
                parts.append(part["text"])
            elif kind in ("image", "image_url"):
                part_images.append(_image_source(part))
                parts.append(IMAGE_PLACEHOLDER)
            else:
                raise SkipSample("bad_content", f"unknown content part {part!r:.60}")
        return "".join(parts)
    raise SkipSample("bad_content", f"content of type {type(value).__name__}")


def _listed_images(record: dict[str, Any]) -> list[str]:
    """The record's top-level ``"images"`` (or ``"image"``) paths."""
    found = record.get("images")
    found = record.get("image") if found is None else found
    if found is None:
        return []
    listed = [found] if isinstance(found, str) else found
    if not isinstance(listed, list) or not all(isinstance(p, str) and p for p in listed):
        raise SkipSample("bad_content", f"'images' must be a path or a list of paths, not {found!r:.60}")
    return listed


def normalize(record: dict[str, Any], fmt: str = "auto", *, text_only: bool = False) -> Conversation:
    """``record`` as a conversation; ``text_only``: for a text model, which cannot take images."""
    fmt = detect_format(record) if fmt == "auto" else fmt
    if fmt == "messages":
        turns = record.get("messages")
        role_key, text_key = "role", "content"
    else:
        turns = record.get("conversations")
        role_key, text_key = "from", "value"
    if not isinstance(turns, list) or not turns:
        raise SkipSample("no_messages", f"no '{'messages' if fmt == 'messages' else 'conversations'}' list")
    messages: list[dict[str, str]] = []
    part_images: list[str | None] = []  # each image part's path, None when it carries none
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(role_key) not in _ROLES:
            raise SkipSample("bad_role", f"turn {turn!r:.60}")
        text = _content(turn.get(text_key), part_images)
        if not text.strip():
            raise SkipSample("empty_content", f"an empty {turn.get(role_key)} turn")
        messages.append({"role": _ROLES[turn[role_key]], "content": text})
    listed = _listed_images(record)
    if text_only and (listed or part_images):
        raise SkipSample("image_for_text_model", f"{max(len(listed), len(part_images))} image(s) for a text-only "
                         "model; train a vision-language model (e.g. Qwen2-VL) or drop the images from the data")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    own = [path for path in part_images if path is not None]
    if listed and own:
        raise SkipSample("mixed_image_sources", "image parts carry their own paths and the record also has a "
                         "top-level 'images' list; put every path in its part, or every path in 'images' "
                         "and none in the parts")
    if not listed and len(own) < len(part_images):
        raise SkipSample("image_placeholder_mismatch", f"{len(part_images) - len(own)} image part(s) without a "
                         "path and no top-level 'images' list to take them from")
    images = listed or own
    if not images:  # no image: '<image>' is text
        return Conversation(messages, [])
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    first_user = next((m for m in messages if m["role"] == "user"), None)
    if len(images) == 1 and placeholders == 0 and first_user:  # LLaVA files sometimes omit it
        first_user["content"] = IMAGE_PLACEHOLDER + "\n" + first_user["content"]
        placeholders = 1
    if placeholders != len(images):
        raise SkipSample("image_placeholder_mismatch", f"{placeholders} <image> for {len(images)} images")
    return Conversation(messages, images)
