"""Preference records (DPO and its kin) -> a prompt and two answers, and a pair sample's two sequences.

A preference record holds a prompt and two answers to it, ``chosen`` and ``rejected``. The formats
users bring, told apart per record:

* (a) TRL, plain: ``{"prompt": str, "chosen": str, "rejected": str}``.
* (b) TRL, conversational with an explicit prompt: ``{"prompt": [messages], "chosen": [the answer
  turn(s)], "rejected": [...]}``.
* (c) UltraFeedback-binarized: ``{"prompt": str, "chosen": [the whole conversation: the prompt
  turns, then the answer], "rejected": [...]}``.
* (d) TRL, implicit prompt: ``{"chosen": [conversation], "rejected": [conversation]}``.
* (e) SFT-style prompt turns: ``{"messages" | "conversations": [the prompt turns], "chosen": ...,
  "rejected": ...}`` (LLaMA-Factory's ShareGPT preference records give each answer as one
  ``{"from": "gpt", "value": ...}`` turn).

The turns are read as :func:`odb.data.formats.normalize` reads them (roles, ShareGPT's ``from`` /
``value``, content parts, tool calls, reasoning, ``tools``, ``images``), each side as its whole
conversation: the prompt, then that answer. An answer given as a string is one assistant turn, as
one object one turn, as a list its turns; a prompt given as a string is one user turn. A ``system``
string field opens the prompt as a system turn (a record with a system turn too is ``bad_content``).

Where the answers' lists hold the prompt (their first turn is not the assistant's: formats c and
d), each answer is its list's final turn, which must be the assistant's, and the prompt is the turns
before it, which must be the same in both lists (as normalized), and match a ``prompt`` given beside
them (a string: the text of the prompt's last user turn; a list: the prompt turns themselves), else
``pair_prompt_mismatch``. Otherwise the prompt is ``prompt`` (else ``messages``, else
``conversations``) and each answer must end with an assistant turn. Under the labels of
:mod:`odb.data.processing` (``train_on`` 'last') a side trains on its final assistant turn.

An image or video belongs to the prompt (both sequences carry it); one in an answer is
``pair_media_not_supported``. A record without ``chosen`` and ``rejected`` is ``not_a_pair``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from odb.data.formats import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, SkipSample, normalize, role_of, text_of

__all__ = ["PAIR_KEYS", "Pair", "is_preference", "pair_answer_tokens", "pair_sequences", "split_pair"]

PAIR_KEYS = ("chosen", "rejected")
"""The keys that make a record a preference record."""
_PROMPT_KEYS = ("prompt", "messages", "conversations")
_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""A sample's image and video tensors (:data:`odb.data.media.MEDIA`'s keys), each twice in a pair."""
_EXPECTED = ("a preference record needs 'chosen' and 'rejected' (each a string, one turn or a list of turns) and "
             "its prompt: 'prompt' (a string or a list of turns), 'messages' or 'conversations' (the prompt turns), "
             "or the whole conversations in 'chosen' and 'rejected'")


@dataclass(frozen=True)
class Pair:
    """A preference record, normalized: the prompt's messages and each answer's, the prompt's
    images and videos, and the record's tools."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    images: list[str] = field(default_factory=list)
    videos: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


def is_preference(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` is a preference record: it has ``chosen`` and ``rejected`` (not null)."""
    return all(record.get(key) is not None for key in PAIR_KEYS)


def _turns(value: Any, role: str, what: str) -> list[Any]:
    """A prompt's or an answer's turns: a string is one turn of ``role``, an object one turn."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value:
        return list(value)
    kind = "an empty list" if value == [] else f"of type {type(value).__name__}"
    raise SkipSample("not_a_pair", f"'{what}' is {kind}; {_EXPECTED}")


def _as_message(turn: Any) -> Any:
    """A ShareGPT turn (``from``, ``value``) as a ``messages`` turn (``role``, ``content``), so that
    prompt and answer, however each is written, are read as one conversation."""
    if not isinstance(turn, dict) or "role" in turn or "from" not in turn:
        return turn
    return {"role": turn["from"], "content": turn.get("value"),
            **{k: v for k, v in turn.items() if k not in ("from", "value")}}


def _side(record: Mapping[str, Any], turns: list[Any], text_only: bool):
    """One side's whole conversation, normalized with the record's images, videos and tools."""
    return normalize({**record, "messages": [_as_message(turn) for turn in turns]}, "messages", text_only=text_only)


def _given_prompt(record: Mapping[str, Any], fmt: str) -> tuple[str | None, Any]:
    """The key and value of the record's explicit prompt (``prompt``, else the prompt turns of
    ``fmt``'s key), ``(None, None)`` when it has none."""
    keys = {"messages": ("prompt", "messages"), "sharegpt": ("prompt", "conversations"),
            "llava": ("prompt", "conversations")}.get(fmt, _PROMPT_KEYS)
    return next(((key, record[key]) for key in keys if record.get(key) is not None), (None, None))


def _system(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The record's ``system`` field as a system turn (none when absent)."""
    system = record.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise SkipSample("bad_content", f"'system' must be a string, not {system!r:.60}")
    return [{"role": "system", "content": system}]


def split_pair(record: Mapping[str, Any], fmt: str = "auto", *, text_only: bool = False) -> Pair:
    """A preference record's prompt and answers (the module docstring has the formats).

    Args:
        record: the record.
        fmt: ``DataConfig.format``: 'messages' reads the prompt turns (format e) from ``messages``,
            'sharegpt' and 'llava' from ``conversations``, 'auto' from whichever it has.
        text_only: for a text model, which cannot take images (:func:`odb.data.formats.normalize`).

    Raises:
        SkipSample: the record is no pair (``not_a_pair``), its prompts differ
            (``pair_prompt_mismatch``), an answer holds an image or a video
            (``pair_media_not_supported``), or a reason of :func:`odb.data.formats.normalize`.
    """
    if not is_preference(record):
        raise SkipSample("not_a_pair", f"{_EXPECTED}; this record has {sorted(record)}")
    chosen, rejected = (_turns(record[key], "assistant", key) for key in PAIR_KEYS)
    holds_prompt = [role_of(turns[0]) != "assistant" for turns in (chosen, rejected)]
    system = _system(record)
    if any(holds_prompt):
        _one_system(system, chosen)
        if not all(holds_prompt):
            which = "chosen" if holds_prompt[0] else "rejected"
            raise SkipSample("pair_prompt_mismatch", f"'{which}' holds the prompt turns (its first turn is not the "
                             "assistant's) and the other holds its answer only; give both whole conversations, or "
                             "both answers only beside a 'prompt'")
        sides = [_side(record, system + turns, text_only) for turns in (chosen, rejected)]
        prompt = _shared_prompt(sides[0].messages, sides[1].messages, record.get("prompt"),
                                [_as_message(turn) for turn in chosen[:-1]])
    else:
        key, value = _given_prompt(record, fmt)
        if key is None:
            raise SkipSample("not_a_pair", f"no prompt: 'chosen' and 'rejected' hold answers only; {_EXPECTED}")
        prompt_turns = _turns(value, "user", key)
        _one_system(system, prompt_turns)
        sides = [_side(record, system + prompt_turns + turns, text_only) for turns in (chosen, rejected)]
        prompt = sides[0].messages[:len(system) + len(prompt_turns)]
    answers = [side.messages[len(prompt):] for side in sides]
    for name, answer in zip(PAIR_KEYS, answers):
        if answer[-1]["role"] != "assistant":
            raise SkipSample("not_a_pair", f"'{name}' ends with a {answer[-1]['role']} turn, not the assistant's "
                             "answer")
    media = sides[0].images or sides[0].videos or sides[1].images or sides[1].videos
    in_answers = [name for name, answer in zip(PAIR_KEYS, answers) for m in answer
                  if IMAGE_PLACEHOLDER in text_of(m) or VIDEO_PLACEHOLDER in text_of(m)]
    if media and in_answers:
        raise SkipSample("pair_media_not_supported", f"an image or video in the '{in_answers[0]}' answer: a pair's "
                         "two sequences carry the prompt's images and videos only; move it into the prompt")
    return Pair(prompt, answers[0], answers[1], sides[0].images, sides[0].videos, sides[0].tools)


def _one_system(system: list[dict[str, Any]], turns: list[Any]) -> None:
    """Refuses a ``system`` field beside a prompt that opens with a system turn of its own."""
    if system and role_of(turns[0]) == "system":
        raise SkipSample("bad_content", "a 'system' field and a system turn opening the prompt: give one")


def _shared_prompt(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]], given: Any,
                   given_turns: list[Any] | None) -> list[dict[str, Any]]:
    """The prompt of two whole conversations (normalized): the turns before each final turn, the
    same in both and matching ``given``, the record's ``prompt`` (None where it has none; a list:
    ``given_turns``, the raw turns it must equal)."""
    prompt = chosen[:-1]
    if prompt != rejected[:-1]:
        at = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        turns = [side[at] if at < len(side) else None for side in (chosen, rejected)]
        raise SkipSample("pair_prompt_mismatch", f"'chosen' and 'rejected' differ before their final answers (at "
                         f"turn {at}: {turns[0]!r:.60} vs {turns[1]!r:.60}); each answer is its list's final turn and "
                         "the turns before it are the prompt, the same in both")
    if not prompt:
        raise SkipSample("not_a_pair", f"'chosen' and 'rejected' are one turn each and there is no prompt; {_EXPECTED}")
    if isinstance(given, str):
        users = [m for m in prompt if m["role"] == "user"]
        last = text_of(users[-1]) if users else None
        if last is None or last.strip() != given.strip():
            raise SkipSample("pair_prompt_mismatch", f"'prompt' ({given!r:.60}) is not the last user turn of the "
                             f"conversations' prompt ({last!r:.60})")
    elif isinstance(given, list) and [_as_message(turn) for turn in given] != given_turns:
        raise SkipSample("pair_prompt_mismatch", f"'prompt' ({len(given)} turns) is not the turns before the final "
                         f"answer in 'chosen' and 'rejected' ({len(prompt)} turns)")
    return prompt


def pair_answer_tokens(prompt_tokens: tuple[int, int], tokens: tuple[int, int], cap: int) -> tuple[int, int]:
    """The answer tokens each side of a pair keeps under ``cap`` tokens in all (over_cap 'truncate').

    The prompts are never cut; the answers share what is left, ``budget = cap - prompt_c -
    prompt_r``: the shorter answer keeps all of its tokens up to half of it (``budget // 2``) and the
    longer one (chosen on a tie) the rest, so the end of the longer answer is cut first and the two
    end as even as the budget allows. Prompts 100 and 100, answers 6000 and 40, cap 4096: budget
    3896, rejected keeps its 40, chosen 3856.

    Args:
        prompt_tokens: each side's tokens before its first label token (chosen, rejected).
        tokens: each side's tokens in all.
        cap: the pair's token cap (``truncate_to``).

    Returns:
        ``(chosen, rejected)`` answer tokens to keep (all of them where the pair fits).

    Raises:
        SkipSample: ``over_cap``, where the prompts and one answer token each do not fit.
    """
    answers = [total - prompt for prompt, total in zip(prompt_tokens, tokens)]
    budget = cap - sum(prompt_tokens)
    if sum(answers) <= budget:
        return answers[0], answers[1]
    if budget < 2:
        raise SkipSample("over_cap", f"the pair's prompt in both sequences ({prompt_tokens[0]} + {prompt_tokens[1]} "
                         f"tokens) and one answer token each do not fit max_tokens {cap}: raise max_tokens or "
                         "shorten the prompt")
    longer = 0 if answers[0] >= answers[1] else 1
    shorter = min(answers[1 - longer], budget // 2)
    kept = [0, 0]
    kept[1 - longer], kept[longer] = shorter, budget - shorter
    return kept[0], kept[1]


def pair_sequences(sample: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A pair sample's two sequences as samples of their own, chosen first, then rejected: each
    ``{"input_ids", "labels", "source", "uid", "index"}``, its tokens and labels sliced by
    ``sample["pair"]`` (tensors or numpy arrays alike). A sample with images or videos gives each
    sequence its own copy of them too (``pixel_values``, ``image_grid_thw``, ... and ``patches``):
    the first half of each for chosen, the second for rejected."""
    num_chosen, num_rejected = sample["pair"]
    assert len(sample["input_ids"]) == num_chosen + num_rejected == len(sample["labels"]), "not a pair sample"
    cuts = (slice(0, num_chosen), slice(num_chosen, num_chosen + num_rejected))
    out = [{"input_ids": sample["input_ids"][cut], "labels": sample["labels"][cut], "source": sample["source"],
            "uid": sample["uid"], "index": sample["index"]} for cut in cuts]
    media = [key for key in _MEDIA_KEYS if key in sample]
    for key in media:
        half = len(sample[key]) // 2
        out[0][key], out[1][key] = sample[key][:half], sample[key][half:]
    if media:
        for sequence in out:
            sequence["patches"] = int(sample["patches"]) // 2
    return out
