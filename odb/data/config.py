"""How records become samples: :class:`DataConfig` (``configs/data.json``, ``--data_config``) and
its loader. Light (no torch): ``launch/train.py`` checks it before the heavy imports; the
processing itself is :mod:`odb.data.processing`'s."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from odb.data.formats import FORMATS
from odb.data.labels import TRAIN_ON
from odb.settings import (
    JSON_METAVAR,
    ConfigSource,
    check_bool,
    check_int,
    check_number,
    check_str,
    flag,
    load_json_config,
)

__all__ = ["SYSTEM_MESSAGE", "TRUNCATION", "DataConfig", "load_data_config"]


TRUNCATION = ("turns", "tokens")
"""Where a sample over the token cap is cut (``DataConfig.truncation``)."""
SYSTEM_MESSAGE = ("keep", "fold")
"""What becomes of a record's system message (``DataConfig.system_message``)."""
_SET_BY_ODB = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
               "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
               "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
"""``apply_chat_template``'s own arguments, which odb sets per rendering (or a record's ``tools``)."""


def _json_object(text: str) -> dict[str, Any]:
    """``--chat_template_kwargs``'s text -> the mapping it writes."""
    try:
        value = json.loads(text)
    except ValueError:  # (not JSON: refused below)
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"--chat_template_kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
                         f"got {text!r}")
    return value


def _check_template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` checked, as a plain JSON copy (run_config.json and the ranks' settings
    check hold it)."""
    example = 'e.g. {"enable_thinking": false}'
    if not isinstance(value, Mapping) or not all(isinstance(key, str) and key.isidentifier() for key in value):
        raise ValueError(f"chat_template_kwargs must map template variable names to values ({example}), "
                         f"got {value!r}")
    taken = sorted(set(value) & set(_SET_BY_ODB))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}: odb passes apply_chat_template's own arguments "
                         "itself (the messages, each record's tools, the generation prompt, tokenize); give only "
                         f"the variables the template reads ({example})")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"chat_template_kwargs must hold JSON values (strings, numbers, true/false, null, lists, "
                         f"objects), got {value!r}: {err}") from None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How records become samples (``configs/data.json``, ``--data_config``)."""

    format: str = field(default="auto", metadata=flag("--data_format", choices=FORMATS))
    """The records' format: auto (detected per record), messages, sharegpt or llava."""
    train_on: str = "assistant"
    """'assistant': labels on every assistant turn (answer and end-of-turn token), found with any chat
    template; 'last': on the final assistant turn only, for templates that rewrite past turns (e.g.
    Qwen3's, which drops their reasoning); 'all': every text token."""
    truncation: str = "turns"
    """How a sample over the token cap is cut (over_cap 'truncate' only): 'turns' drops whole trailing
    turns, ending on a complete assistant turn (the token cut if even the first does not fit);
    'tokens' cuts at the cap."""
    strict: bool = False
    """Stop at the first bad record (file, line, reason) instead of skipping and counting it."""
    system_message: str = field(default="keep", metadata=flag(choices=SYSTEM_MESSAGE))
    """'keep': a record's system message goes to the chat template as it is; 'fold': its text opens the
    user turn after it (system text, blank line, user text), for templates that refuse a system
    message (Gemma 2's) or drop it from a finished conversation (Mistral v0.3's, Mistral-Nemo's), whose
    records 'keep' skips."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False, metadata=flag(
        parse=_json_object, metavar=JSON_METAVAR))
    """Variables for the chat template, passed to every rendering odb makes (the training text and the
    label search alike), e.g. {"enable_thinking": false} for Qwen3; on the command line a JSON object."""
    system_prompts: tuple[str, ...] = ()
    """Augmentation: with probability system_prompt_prob, a random one of these as system turn."""
    system_prompt_prob: float = 0.0
    turn_sampling: bool = False
    """Augmentation: keep a random number (>= 1) of the leading user/assistant exchanges."""
    image_folder: str | None = None
    """Where relative image paths start (default: the data file's folder)."""
    min_pixels: int | None = None
    """Images are resized to at least this many pixels; None: the model's image processor's own bound."""
    max_pixels: int | None = None
    """Images are resized to at most this many pixels; None: the model's image processor's own bound."""
    video_fps: float | None = None
    """Frames sampled per second of video; None: the model's video processor's own rate, else 2."""
    video_num_frames: int | None = None
    """Frames sampled per video instead of a rate (None: sample at video_fps)."""
    video_min_frames: int | None = None
    """At least this many frames per video; None: the model's video processor's own (4 for Qwen-VL)."""
    video_max_frames: int | None = None
    """At most this many frames per video; None: the model's video processor's own (768 for Qwen-VL)."""
    video_min_pixels: int | None = None
    """Video frames are resized to at least this many pixels (per frame for Qwen2-VL / Qwen2.5-VL, per
    clip for Qwen3-VL, as their processors mean it); None: the model's video processor's own."""
    video_max_pixels: int | None = None
    """Video frames are resized to at most this many pixels (per frame for Qwen2-VL / Qwen2.5-VL, per
    clip for Qwen3-VL); None: the model's video processor's own."""
    video_max_tokens: int | None = None
    """The other bound (the processor's cap_pixels_per_frame with this max_video_tokens): Qwen2-VL /
    Qwen2.5-VL bound a whole video to 0.9 x this many visual tokens' pixels, shared by its frames
    (at least 1.05 x video_min_pixels each); Qwen3-VL bound each frame to this many visual tokens'
    pixels (and to its share of video_max_pixels; at least 1.05 x video_min_pixels, a per-clip
    figure, per frame). None: the model's video processor's own setting."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data format must be one of {FORMATS}, got {self.format!r}")
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {TRAIN_ON} ('last' or 'all' for a chat template that "
                             f"rewrites past turns), got {self.train_on!r}")
        if self.truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {self.truncation!r}")
        check_bool("strict", self.strict)
        if self.system_message not in SYSTEM_MESSAGE:
            raise ValueError(f"system_message must be one of {SYSTEM_MESSAGE}, got {self.system_message!r}")
        object.__setattr__(self, "chat_template_kwargs", _check_template_kwargs(self.chat_template_kwargs))
        check_bool("turn_sampling", self.turn_sampling)
        prompts = self.system_prompts
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(prompt, str) for prompt in prompts):
            raise ValueError(f"system_prompts must be a list of strings, got {self.system_prompts!r}")
        check_number("system_prompt_prob", self.system_prompt_prob, 0, 1)
        if self.system_prompt_prob and not self.system_prompts:
            raise ValueError("system_prompt_prob > 0 needs system_prompts to choose from")
        if self.image_folder is not None:
            check_str("image_folder", self.image_folder)
        for name in ("min_pixels", "max_pixels", "video_num_frames", "video_min_frames", "video_max_frames",
                     "video_min_pixels", "video_max_pixels", "video_max_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.video_fps is not None:
            check_number("video_fps", self.video_fps, 0)
            if self.video_fps <= 0:
                raise ValueError(f"video_fps must be > 0, got {self.video_fps}")
        if self.video_fps is not None and self.video_num_frames is not None:
            raise ValueError("set video_fps or video_num_frames, not both")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"need min_pixels <= max_pixels, got {self.min_pixels} > {self.max_pixels}")
        object.__setattr__(self, "system_prompts", tuple(self.system_prompts))

    def video_settings(self) -> dict[str, Any]:
        """The video processor overrides (:func:`odb.data.videos.video_spec_for`)."""
        return {"fps": self.video_fps, "num_frames": self.video_num_frames, "min_frames": self.video_min_frames,
                "max_frames": self.video_max_frames, "min_pixels": self.video_min_pixels,
                "max_pixels": self.video_max_pixels, "max_video_tokens": self.video_max_tokens,
                "cap_pixels_per_frame": True if self.video_max_tokens is not None else None}


def load_data_config(path: ConfigSource | None, **overrides: Any) -> DataConfig:
    """Reads a data JSON or YAML file (or a recipe's inline mapping; None: the defaults) strictly;
    ``overrides`` (not None) win over the file."""
    known = [f.name for f in dataclasses.fields(DataConfig)]
    values = load_json_config(path, known=known, what="data config",
                              fix="pass --data_config configs/data.json") if path else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return DataConfig(**values)
