"""Which tokens of a chat to train on, with any chat template.

``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks assistant tokens only where
the template wraps them in ``{% generation %}`` blocks; the stock templates of Qwen2.5, Qwen2-VL,
Llama 3, Mistral and Gemma have none, and the mask comes back all zeros without a word. So odb
finds each assistant turn by rendering the conversation prefix by prefix, one code path for every
template. For an assistant turn at ``messages[k]``::

    prompt   = render(messages[:k], add_generation_prompt=True)
    through  = render(messages[:k + 1])
    span     = through[len(prompt):], less the whitespace after its end-of-turn token

ChatML, worked through (``.`` stands for a newline; ``messages[1]`` is the assistant's)::

    prompt    <|im_start|>user.Hi<|im_end|>.<|im_start|>assistant.
    through   <|im_start|>user.Hi<|im_end|>.<|im_start|>assistant.Hello!<|im_end|>.
    span                                                          Hello!<|im_end|>

The span is what the model must generate after the generation prompt: the answer and its
end-of-turn token, nothing of the system, user or header tokens. Leading whitespace that the
template puts after the generation prompt (Mistral's ``[/INST] Hello``) belongs to the answer,
since the model generates it; trailing whitespace after the end-of-turn token (ChatML's and
Gemma's newline) is the template's separator, which the model never generates.

The renderings must extend one another (each a prefix of the next, the last a prefix of the whole
conversation's); then the spans are spans of the one full rendering. That rendering is tokenized
once, exactly as ``apply_chat_template(messages, tokenize=True)`` does (``add_special_tokens=False``),
and a token is labelled if its characters (the fast tokenizer's offsets) overlap a span, as
transformers does for ``{% generation %}`` masks. The price: two renderings per assistant turn
(about 0.6 ms a sample on the bundled chat data, twice the ``{% generation %}`` path).

A template that rewrites earlier turns once later ones follow (Qwen3's drops the ``<think>``
reasoning of past assistant turns) breaks the chain: :class:`TemplateMismatch`, which names the
two fallbacks of :data:`TRAIN_ON`: ``"last"`` (labels on the final assistant turn, whose rendering
still extends the prompt before it) and ``"all"`` (every token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TRAIN_ON", "LabelledChat", "TemplateMismatch", "assistant_char_spans", "encode_chat", "token_spans"]

TRAIN_ON = ("assistant", "last", "all")
"""What to label: every assistant turn, the final assistant turn only, or every token."""

_FALLBACKS = ("set train_on in the data config to 'last' (labels on the final assistant turn only) or 'all' "
              "(labels on every token)")


class TemplateMismatch(ValueError):
    """The chat template's renderings of a conversation's prefixes do not extend one another, so
    its assistant turns cannot be found in the full rendering. The message names the fix."""


@dataclass(frozen=True)
class LabelledChat:
    """A conversation rendered, tokenized and labelled.

    Attributes:
        text: the full rendering (``apply_chat_template(messages, tokenize=False)``).
        input_ids: its tokens, those of ``apply_chat_template(messages, tokenize=True)``.
        label_spans: token ranges ``[start, end)`` to train on, in order.
        turn_ends: the token positions just past each complete assistant turn that was found, in
            order: where a sample may be cut between turns (see ``DataConfig.truncation``).
    """

    text: str
    input_ids: list[int]
    label_spans: list[tuple[int, int]]
    turn_ends: list[int]


def _render(tokenizer, messages: Sequence[dict], *, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _check_extends(before: str, after: str, what: str, fix: str) -> None:
    """Raises :class:`TemplateMismatch` unless ``after`` starts with ``before``."""
    if after.startswith(before):
        return
    at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    raise TemplateMismatch(
        f"the chat template renders a conversation differently once later turns follow ({what}; they part at "
        f"character {at}: {before[at:at + 40]!r} vs {after[at:at + 40]!r}), as a template that rewrites past "
        f"turns does (e.g. one that strips <think> reasoning from earlier assistant turns); {fix}")


def assistant_char_spans(tokenizer, messages: Sequence[dict], *, last_only: bool = False
                         ) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering of ``messages`` and the character spans of its assistant turns.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``{"role", "content"}`` dicts.
        last_only: find the final assistant turn only (``train_on="last"``).

    Returns:
        ``(text, spans)``: ``text`` is ``apply_chat_template(messages, tokenize=False)``; each
        span ``[start, end)`` of it holds an assistant answer and its end-of-turn token (a turn
        that renders as whitespace only has none).

    Raises:
        TemplateMismatch: the renderings of the prefixes do not extend one another, or an
            assistant turn opens the conversation (no prompt renders before it).
    """
    turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    fix = "set train_on in the data config to 'all' (labels on every token)" if last_only else _FALLBACKS
    spans: list[tuple[int, int]] = []
    previous, through = "", ""
    for k in turns:
        if k == 0:
            raise TemplateMismatch("the conversation opens with an assistant turn, so no prompt renders before it "
                                   "to tell the answer from the template's own text; start it with a user (or "
                                   "system) turn, or set train_on in the data config to 'all'")
        prompt = _render(tokenizer, messages[:k], generation_prompt=True)
        _check_extends(previous, prompt, f"messages[:{k}] with the generation prompt does not extend the "
                                         "rendering before it", fix)
        through = _render(tokenizer, messages[:k + 1])
        _check_extends(prompt, through, f"messages[:{k + 1}] does not extend messages[:{k}] with the "
                                        "generation prompt", fix)
        end = max(len(prompt), len(through.rstrip()))
        if end > len(prompt):
            spans.append((len(prompt), end))
        previous = through
    text = through if turns and turns[-1] == len(messages) - 1 else _render(tokenizer, messages)
    _check_extends(previous, text, "the whole conversation does not extend its rendering through the last "
                                   "assistant turn", fix)
    return text, spans


def token_spans(offsets: Sequence[tuple[int, int]], char_spans: Sequence[tuple[int, int]]
                ) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of the tokens whose characters overlap each of ``char_spans``.

    Args:
        offsets: each token's ``(start, end)`` characters (the fast tokenizer's offsets), in order.
        char_spans: disjoint character ranges, in order.

    Returns:
        One token range per character span that some token overlaps, in order.
    """
    out: list[tuple[int, int]] = []
    token = 0
    for start, end in char_spans:
        while token < len(offsets) and offsets[token][1] <= start:
            token += 1
        first = token
        while token < len(offsets) and offsets[token][0] < end:
            token += 1
        if token > first:
            out.append((first, token))
    return out


def encode_chat(tokenizer, messages: Sequence[dict], train_on: str = "assistant") -> LabelledChat:
    """Renders, tokenizes and labels a conversation.

    Args:
        tokenizer: a fast tokenizer (it gives character offsets) with a chat template.
        messages: ``{"role", "content"}`` dicts.
        train_on: one of :data:`TRAIN_ON`. Under ``"all"`` every token is labelled, and the
            assistant turns are still looked for, for ``turn_ends``: where the template
            rewrites past turns there are none.

    Returns:
        The :class:`LabelledChat`.

    Raises:
        TemplateMismatch: under ``"assistant"`` or ``"last"``, see :func:`assistant_char_spans`.
        ValueError: ``train_on`` is unknown, or the tokenizer gives no offsets.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} gives no character offsets, which odb needs to find the "
                         "assistant tokens; load the model's fast tokenizer (AutoTokenizer, use_fast=True)")
    try:
        text, char_spans = assistant_char_spans(tokenizer, messages, last_only=train_on == "last")
    except TemplateMismatch:
        if train_on != "all":
            raise
        text, char_spans = _render(tokenizer, messages), []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    spans = token_spans(encoded["offset_mapping"], char_spans)
    labelled = [(0, len(input_ids))] if train_on == "all" else spans
    return LabelledChat(text, input_ids, labelled, [end for _, end in spans])
