"""The conversation formats fine-tuning users have, normalized to one shape.

* ``messages`` (OpenAI / UltraChat): ``{"messages": [{"role": "user", "content": "..."}, ...]}``;
  content may also be a list of parts (``{"type": "text", "text": ...}``, ``{"type": "image",
  "image": path}``), an image part becoming an ``<image>`` placeholder.
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}``.
* ``llava``: ShareGPT plus ``"image": path`` (or ``"images": [...]``) and ``<image>``
  placeholders in the turns.

:func:`normalize` returns ``Conversation(messages, images)``, with roles system / user /
assistant and one ``<image>`` placeholder per image, or raises :class:`SkipSample` with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Conversation", "SkipSample", "detect_format", "normalize", "IMAGE_PLACEHOLDER", "FORMATS"]

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


def _content(value: Any, images: list[str]) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(str(part.get("text", "")))
            elif kind in ("image", "image_url"):
                source = part.get("image") or part.get("image_url")
                images.append(source["url"] if isinstance(source, dict) else source)
                parts.append(IMAGE_PLACEHOLDER)
            else:
                raise SkipSample("bad_content", f"unknown content part {part!r:.60}")
        return "".join(parts)
    raise SkipSample("bad_content", f"content of type {type(value).__name__}")


def normalize(record: dict[str, Any], fmt: str = "auto") -> Conversation:
    fmt = detect_format(record) if fmt == "auto" else fmt
    images: list[str] = []
    if fmt == "messages":
        turns = record.get("messages")
        role_key, text_key = "role", "content"
    else:
        turns = record.get("conversations")
        role_key, text_key = "from", "value"
        if fmt == "llava":
            found = record.get("images", record.get("image"))
            images = [found] if isinstance(found, str) else list(found or [])
    if not isinstance(turns, list) or not turns:
        raise SkipSample("no_messages", f"no '{'messages' if fmt == 'messages' else 'conversations'}' list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(role_key) not in _ROLES:
            raise SkipSample("bad_role", f"turn {turn!r:.60}")
        text = _content(turn.get(text_key), images)
        if not text.strip():
            raise SkipSample("empty_content", f"an empty {turn.get(role_key)} turn")
        messages.append({"role": _ROLES[turn[role_key]], "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    first_user = next((m for m in messages if m["role"] == "user"), None)
    if len(images) == 1 and placeholders == 0 and first_user:  # LLaVA files sometimes omit it
        first_user["content"] = IMAGE_PLACEHOLDER + "\n" + first_user["content"]
        placeholders = 1
    if placeholders != len(images):
        raise SkipSample("image_placeholder_mismatch", f"{placeholders} <image> for {len(images)} images")
    return Conversation(messages, images)
