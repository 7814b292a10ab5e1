"""The conversation formats fine-tuning users have, normalized to one shape.

* ``messages`` (OpenAI / UltraChat / TRL): ``{"messages": [{"role": "user", "content": "..."}, ...]}``;
  content may also be a list of parts: ``{"type": "text", "text": ...}``, an image part carrying
  its path (``{"type": "image", "image": path}``, ``{"type": "image_url", "image_url": {"url":
  path}}``), or ``{"type": "image"}`` with no path (TRL / Hugging Face style: the paths are in a
  top-level ``"images": [...]``, in order). Each image part becomes an ``<image>`` placeholder.
  A video part (``{"type": "video", "video": path}``, also ``video_url``) carries a video file or
  a list of frame image paths (optionally ``"fps"``: the frames' rate), or nothing (the videos
  are then in a top-level ``"videos": [...]``); each becomes a ``<video>`` placeholder.
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}``;
  LLaMA-Factory's ``function_call`` turns (the value: a JSON call ``{"name", "arguments"}`` or a
  list of them) become assistant tool calls and its ``observation`` turns tool results.
* ``llava``: ShareGPT plus ``"image": path`` (or ``"images": [...]``) and ``<image>``
  placeholders in the turns; video data (LLaVA-Video, LLaMA-Factory) ``"video": path`` (or a list
  of frame paths) or ``"videos": [...]`` (each a file or a list of frame paths) and ``<video>``.

Tool calls and reasoning reach the chat template as the OpenAI / transformers message format has
them: an assistant turn's ``tool_calls`` (each ``{"type": "function", "function": {"name",
"arguments"}, "id"?}``; a bare ``{"name", "arguments"}`` is wrapped so; ``arguments`` given as a
JSON object in a string, as the OpenAI wire format has them, become that object, which the stock
Qwen2.5, Qwen3, Llama-3.1 and Mistral templates render with ``tojson``), with ``content`` null or
absent where it calls tools only (it reaches the template as ``""``); ``reasoning_content`` (Qwen3,
read by its template into ``<think>``), ``thinking`` and ``reasoning``; a ``tool`` turn (also
``function``, ``observation``, ``ipython``: each becomes ``tool``) with ``name`` and
``tool_call_id``; a record's ``tools`` list (the functions offered; a JSON string too, as
LLaMA-Factory writes it; a bare function schema is wrapped in ``{"type": "function", "function":
...}``), passed as ``apply_chat_template(..., tools=...)``.
A field set to null (as Parquet fills absent fields) counts as absent. A template that ignores
any of these (no tool or reasoning support) skips the record (``template_drops_fields``,
:mod:`odb.data.labels`) rather than train a tool call as an empty answer.

Images: a record's top-level ``"images"`` (or ``"image"``) fill its placeholders in order (in any
format: the ``<image>`` of string contents and the image parts without a path), or else its image
parts carry their own paths; a record that does both is skipped (``mixed_image_sources``), as is a
placeholder count that differs from the image count (``image_placeholder_mismatch``). One image and
no placeholder: it goes before the first user turn (LLaVA files sometimes omit it). In a record
without images ``<image>`` is plain text (a user may ask about the HTML tag). For a text model
(``text_only``) a record with images is skipped (``image_for_text_model``), never trained on
without them. Videos follow the same rules with their own reasons (``mixed_video_sources``,
``video_placeholder_mismatch``; ``video_not_supported`` for a model that takes no video).

:func:`normalize` returns ``Conversation(messages, images, tools, videos)``, with roles system /
user / assistant / tool and one ``<image>`` placeholder per image (``<video>`` per video), or
raises :class:`SkipSample` with a reason. A user or assistant turn with no text (and, for the
assistant, no tool call and no reasoning) is ``empty_content``; an empty system or tool turn is
kept as the template renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMATS", "IMAGE_PLACEHOLDER", "SKIP_REASONS", "VIDEO_PLACEHOLDER", "Conversation", "SkipSample",
           "detect_format", "fold_system_messages", "normalize", "role_of", "text_of"]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
FORMATS = ("auto", "messages", "sharegpt", "llava")
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "model": "assistant", "bot": "assistant", "tool": "tool", "function": "tool", "observation": "tool",
          "ipython": "tool", "function_call": "assistant"}
_TEXT_FIELDS = ("reasoning_content", "thinking", "reasoning", "name", "tool_call_id")
"""Per-message string fields the stock templates read, kept as they are."""


SKIP_REASONS = ("not_json", "not_an_object", "no_messages", "bad_role", "bad_content", "empty_content",
                "no_assistant_turn", "image_placeholder_mismatch", "mixed_image_sources", "image_for_text_model",
                "missing_image", "unreadable_image", "video_placeholder_mismatch", "mixed_video_sources",
                "video_not_supported", "missing_video", "unreadable_video", "image_token_mismatch", "template_mismatch",
                "template_drops_fields", "no_labels", "over_cap", "not_a_pair", "pair_prompt_mismatch",
                "pair_media_not_supported", "preference_record", "no_reference", "error")
"""Every :class:`SkipSample` reason, in the order the run's totals count them (metrics, summary).

The preference reasons (:mod:`odb.data.preference`): ``not_a_pair``, a record without ``chosen``
and ``rejected`` where every record must be a pair (``SampleDataset(pairs=True)``);
``pair_prompt_mismatch``, chosen and rejected conversations (or the ``prompt`` beside them) that
differ before their final answers; ``pair_media_not_supported``, an image or video in an answer
(a pair carries its prompt's only); ``preference_record``, a preference record with its prompt
turns under ``messages`` / ``conversations`` read as a next-token (SFT) sample, which would train
the prompt's turns and neither answer; ``no_reference``, a pair without ``ref_chosen_logps`` and
``ref_rejected_logps`` where the run's reference is the records' own (``--reference data``)."""


class SkipSample(Exception):
    """A record that cannot become a training sample; ``reason`` is a short key for counting."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


@dataclass
class Conversation:
    """A normalized record: its messages (``role``, ``content`` (a string, ``""`` for an assistant
    turn that only calls tools) and the kept fields), its image paths and its tools."""

    messages: list[dict[str, Any]]
    images: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    videos: list[dict[str, Any]] = field(default_factory=list)
    """Each ``{"video": a file path or a list of frame image paths, "fps": the frames' rate or None}``."""


def text_of(message: dict[str, Any]) -> str:
    """A normalized message's text."""
    return message.get("content") or ""


def role_of(turn: Any) -> str | None:
    """The role a raw turn (``role`` or ShareGPT's ``from``) normalizes to, None if none is known."""
    raw = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
    return _ROLES.get(raw) if isinstance(raw, str) else None


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each system message's text folded into the user turn after it, as users do
    for a template that refuses or drops system messages (and as Gemma 3's and Mistral v0.1's own
    templates do): ``system text + "\\n\\n" + user text``. Consecutive system messages join with a blank
    line; one with no text is dropped (there is nothing to fold); one that no user turn follows
    stays where it is. New dicts where anything changed; ``messages`` itself is left as it is."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # system messages not folded yet
    for message in messages:
        if message["role"] == "system":
            pending.append(message)
            continue
        if pending and message["role"] == "user":
            texts = [text_of(system) for system in pending if text_of(system).strip()]
            message = {**message, "content": "\n\n".join([*texts, text_of(message)])} if texts else message
        else:
            out += pending
        pending = []
        out.append(message)
    return out + pending


def detect_format(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "llava" if any(key in record for key in ("image", "images", "video", "videos")) else "sharegpt"
    raise SkipSample("no_messages", "a record needs 'messages' or 'conversations'")


def _image_source(part: dict[str, Any]) -> str | None:
    """The path an image part carries, or None when it carries none (TRL style)."""
    source = part.get("image") or part.get("image_url")
    if isinstance(source, dict):
        source = source.get("url")
    if source is not None and not (isinstance(source, str) and source):
        raise SkipSample("bad_content", f"an image part whose path is not a string: {part!r:.60}")
    return source


def _video_source(part: dict[str, Any]) -> dict[str, Any]:
    """The video a video part carries (``source`` None when it carries none, TRL style)."""
    source = part.get("video") or part.get("video_url")
    if isinstance(source, dict):
        source = source.get("url")
    fps = part.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        raise SkipSample("bad_content", f"a video part whose fps is not a positive number: {part!r:.60}")
    return {"video": _video_path(source, part), "fps": fps}


def _video_path(source: Any, where: Any, *, optional: bool = True) -> str | list[str] | None:
    """A video's file path or its frame images' paths, checked (None only where ``optional``: a part
    that carries none)."""
    if (source is None and optional) or (isinstance(source, str) and source):
        return source
    if isinstance(source, list) and source and all(isinstance(p, str) and p for p in source):
        return source
    raise SkipSample("bad_content", f"a video that is not a path or a list of frame paths: {where!r:.60}")


def _content(value: Any, part_images: list[str | None], part_videos: list[dict[str, Any]]) -> str:
    """A turn's text; each image part's path (or None) is appended to ``part_images``, each video
    part's to ``part_videos``."""
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
            elif kind in ("video", "video_url"):
                part_videos.append(_video_source(part))
                parts.append(VIDEO_PLACEHOLDER)
            else:
                raise SkipSample("bad_content", f"unknown content part {part!r:.60}")
        return "".join(parts)
    raise SkipSample("bad_content", f"content of type {type(value).__name__}")


def _json(value: Any, what: str) -> Any:
    """``value``, parsed where it is a JSON string (LLaMA-Factory writes calls and tools so)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise SkipSample("bad_content", f"{what} is not valid JSON ({err}): {value!r:.60}") from None


def _tool_calls(value: Any) -> list[dict[str, Any]]:
    """Tool calls in the OpenAI shape ``{"type": "function", "function": {"name", "arguments"}, "id"?}``."""
    calls = _json(value, "a function call")
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list):
        raise SkipSample("bad_content", f"tool_calls must be a list of calls, not {value!r:.60}")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise SkipSample("bad_content", f"a tool call that is not an object: {call!r:.60}")
        nested = "function" in call
        function = call["function"] if nested else {k: v for k, v in call.items() if k not in ("id", "type")}
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise SkipSample("bad_content", f"a tool call without a function name: {call!r:.60}")
        kept = {k: v for k, v in call.items() if (k != "function" if nested else k == "id") and v is not None}
        out.append({**kept, "type": call.get("type") or "function", "function": _with_object_arguments(function)})
    return out


def _with_object_arguments(function: dict[str, Any]) -> dict[str, Any]:
    """``function`` with ``arguments`` as an object where they come as a JSON object in a string (the
    OpenAI wire format): the stock Qwen2.5, Qwen3, Llama-3.1 and Mistral templates apply ``tojson`` to
    them, so a string would be trained double-encoded (``"{\\"city\\": ...}"``)."""
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return function
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return function  # not JSON: left as written
    return {**function, "arguments": parsed} if isinstance(parsed, dict) else function


def _tools(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The record's ``tools``: each ``{"type": "function", "function": schema}`` (a bare schema is wrapped)."""
    tools = _json(record.get("tools"), "'tools'")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise SkipSample("bad_content", f"'tools' must be a list of function schemas, not {tools!r:.60}")
    return [tool if "function" in tool or "type" in tool else {"type": "function", "function": tool}
            for tool in tools]


def _message(turn: dict[str, Any], role: str, text_key: str, part_images: list[str | None],
             part_videos: list[dict[str, Any]]) -> dict[str, Any]:
    """One turn as a message: role, content and the fields templates read."""
    raw_role = turn.get("role", turn.get("from"))
    if raw_role == "function_call":  # ShareGPT (LLaMA-Factory): the value is the call
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls(turn.get(text_key))}
    message: dict[str, Any] = {"role": role}
    value = turn.get(text_key)
    calls = turn.get("tool_calls")
    # a turn that only calls tools: content "" (transformers drops None keys, and e.g. Qwen3's template reads it)
    only_calls = value is None and role == "assistant" and calls
    message["content"] = "" if only_calls else _content(value, part_images, part_videos)
    if calls:
        if role != "assistant":
            raise SkipSample("bad_content", f"tool_calls on a {role} turn")
        message["tool_calls"] = _tool_calls(calls)
    for key in _TEXT_FIELDS:
        if turn.get(key) is not None:
            if not isinstance(turn[key], str):
                raise SkipSample("bad_content", f"{key} must be a string, not {turn[key]!r:.60}")
            message[key] = turn[key]
    empty = not text_of(message).strip() and not message.get("tool_calls") and \
        not any(message.get(key) for key in ("reasoning_content", "thinking", "reasoning"))
    if empty and role in ("user", "assistant"):
        raise SkipSample("empty_content", f"an empty {raw_role} turn")
    return message


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
    messages: list[dict[str, Any]] = []
    part_images: list[str | None] = []  # each image part's path, None when it carries none
    part_videos: list[dict[str, Any]] = []  # each video part's, its "video" None when it carries none
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(role_key) not in _ROLES:
            raise SkipSample("bad_role", f"turn {turn!r:.60}; known roles: {sorted(_ROLES)}")
        messages.append(_message(turn, _ROLES[turn[role_key]], text_key, part_images, part_videos))
    tools = _tools(record)
    listed = _listed_images(record)
    listed_videos = _listed_videos(record)
    if text_only and (listed or part_images):
        raise SkipSample("image_for_text_model", f"{max(len(listed), len(part_images))} image(s) for a text-only "
                         "model; train a vision-language model (e.g. Qwen2-VL) or drop the images from the data")
    if text_only and (listed_videos or part_videos):
        raise SkipSample("video_not_supported", f"{max(len(listed_videos), len(part_videos))} video(s) for a "
                         "text-only model; train a video-language model (e.g. Qwen2.5-VL) or drop the videos")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    videos = _placed("video", VIDEO_PLACEHOLDER, listed_videos, part_videos, messages)
    images = _placed("image", IMAGE_PLACEHOLDER, listed, part_images, messages)
    return Conversation(messages, images, tools, videos)


def _listed_videos(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's top-level videos: ``"videos"`` (a list, each a file path or a list of frame
    paths) or ``"video"`` (one: a file path or a list of frame paths)."""
    if record.get("videos") not in (None, "", []):
        found = record["videos"]
        listed = [found] if isinstance(found, str) else found
        if not isinstance(listed, list):
            raise SkipSample("bad_content", f"'videos' must be a list of videos, not {found!r:.60}")
    elif record.get("video") not in (None, "", []):
        listed = [record["video"]]
    else:  # absent, null (as Parquet fills absent fields) or empty
        return []
    return [{"video": _video_path(video, video, optional=False), "fps": None} for video in listed]


def _placed(kind: str, placeholder: str, listed: list, parts: list, messages: list[dict[str, Any]]) -> list:
    """The record's images or videos (``kind``) in placeholder order: the top-level list's, or the
    parts' own; one without a placeholder goes before the first user turn."""
    def carried(item) -> bool:
        return (item["video"] if kind == "video" else item) is not None

    own = [item for item in parts if carried(item)]
    if listed and own:
        raise SkipSample(f"mixed_{kind}_sources", f"{kind} parts carry their own paths and the record also has a "
                         f"top-level '{kind}s' list; put every path in its part, or every path in '{kind}s' and none "
                         "in the parts")
    if not listed and len(own) < len(parts):
        raise SkipSample(f"{kind}_placeholder_mismatch", f"{len(parts) - len(own)} {kind} part(s) without a path "
                         f"and no top-level '{kind}s' list to take them from")
    found = listed or own
    if not found:  # none: the placeholder is text
        return []
    placeholders = sum(text_of(m).count(placeholder) for m in messages)
    first_user = next((m for m in messages if m["role"] == "user"), None)
    if len(found) == 1 and placeholders == 0 and first_user:  # LLaVA files sometimes omit it
        first_user["content"] = placeholder + "\n" + first_user["content"]
        placeholders = 1
    if placeholders != len(found):
        raise SkipSample(f"{kind}_placeholder_mismatch", f"{placeholders} {placeholder} for {len(found)} {kind}s")
    return found
