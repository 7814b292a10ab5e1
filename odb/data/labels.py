"""Which tokens of a chat to train on, with any chat template.

``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks assistant tokens only where
the template wraps them in ``{% generation %}`` blocks; the stock templates of Qwen2.5, Qwen2-VL,
Llama 3, Mistral, Gemma and Phi-3 have none, and the mask comes back all zeros without a word. So
odb finds each assistant turn by rendering the conversation prefix by prefix, one code path for
every template. For an assistant turn at ``messages[k]``::

    prompt   = render(messages[:k], add_generation_prompt=True)
    through  = render(messages[:k + 1])
    next     = the rendering that continues the turn: the next assistant turn's prompt, else the
               whole conversation, else (the turn is the last message) the whole conversation
               with a generation prompt after it
    start    = where through parts from prompt (len(prompt) where through extends it)
    end      = where through parts from next, less the whitespace before that point

ChatML, worked through (``.`` stands for a newline; ``messages[1]`` is the assistant's)::

    prompt    <|im_start|>user.Hi<|im_end|>.<|im_start|>assistant.
    through   <|im_start|>user.Hi<|im_end|>.<|im_start|>assistant.Hello!<|im_end|>.
    next      <|im_start|>user.Hi<|im_end|>.<|im_start|>assistant.Hello!<|im_end|>.<|im_start|>assistant.
    span                                                          Hello!<|im_end|>

The span is what the model must generate after the generation prompt: the answer (its tool calls
and reasoning, as the template renders them) and its end-of-turn token, nothing of the system, user,
tool or header tokens. Leading whitespace that the template puts after the generation prompt
(Mistral's ``[/INST] Hello``) belongs to the answer, since the model generates it; trailing
whitespace after the end-of-turn token (ChatML's and Gemma's newline) is the template's separator,
which the model never generates. Two ways a template may part from that picture are one mechanism,
where the renderings part:

* **A trailer.** Phi-3's template ends a rendering with ``eos_token`` unless a generation prompt
  follows: ``through`` = ``...<|assistant|>.Hi!<|end|>.<|endoftext|>`` while ``next`` continues
  ``...<|assistant|>.Hi!<|end|>.<|user|>...``. They part after ``<|end|>.``: the span ends at
  ``<|end|>``, and what ``through`` has past the parting point (``<|endoftext|>``) must be the
  very end of the whole rendering too (a trailer, rendered once), else the template rewrote the
  turn (below).
* **A forced answer prefix.** DeepSeek-R1's generation prompt is ``<｜Assistant｜><think>.``, but
  its assistant turn renders ``<｜Assistant｜>Hi!<｜end▁of▁sentence｜>``: ``through`` parts from the
  prompt inside the generation prompt (where ``render(messages[:k])``, without it, ends), so the
  answer starts there (``Hi!...``); ``<think>.`` is what the prompt forces the model to begin with.
  A parting point before the generation prompt is a mismatch.

Parting points never fall inside an added token (``<|endoftext|>`` and ``<|user|>`` share ``<|``).
The renderings must extend one another up to these points (each turn's rendering through its answer
a prefix of everything after it); then the spans are spans of the one full rendering. That
rendering is tokenized once, exactly as ``apply_chat_template(messages, tools=..., tokenize=True)``
does (``add_special_tokens=False``), and a token is labelled if its characters (the fast
tokenizer's offsets) overlap a span, as transformers does for ``{% generation %}`` masks. The
price: two renderings per assistant turn and one for the conversation (about 0.5 ms a sample on the
bundled chat data, two assistant turns on average; a fifth more than without the trailer check).

A template that rewrites earlier turns once later ones follow (Qwen3's drops the ``<think>``
reasoning of assistant turns before the last user query; Mistral v0.3's shows the system message
inside the last user turn only while that turn is last) breaks the chain: :class:`TemplateMismatch`,
which names where the renderings part and the two fallbacks of :data:`TRAIN_ON`: ``"last"``
(labels on the final assistant turn, whose rendering still extends the prompt before it) and
``"all"`` (every token). A system message whose text the whole rendering lacks (Mistral v0.3 and
Mistral-Nemo drop it once an assistant turn is last) is a mismatch under every ``train_on``: no
rendering of that conversation trains on it; so is one the template refuses (Gemma 2's raises)
where the conversation renders with it folded. Both name ``DataConfig.system_message`` 'fold',
which :mod:`odb.data.processing` applies before the first rendering. Every rendering gets the same
template variables (``DataConfig.chat_template_kwargs``: Qwen3's ``enable_thinking``, Llama 3.1's
``date_string``), so the spans are those of the text that is trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odb.data.rendering import FOLD_FIX, Renderer, TemplateDropsFields, TemplateMismatch, whole_rendering

__all__ = ["TRAIN_ON", "LabelledChat", "TemplateDropsFields", "TemplateMismatch", "assistant_char_spans", "encode_chat",
           "label_runs", "token_spans"]

TRAIN_ON = ("assistant", "last", "all")
"""What to label: every assistant turn, the final assistant turn only, or every token."""

_FALLBACKS = ("set train_on in the data config to 'last' (labels on the final assistant turn only) or 'all' "
              "(labels on every token)")


@dataclass(frozen=True)
class LabelledChat:
    """A conversation rendered, tokenized and labelled.

    Attributes:
        text: the full rendering (``apply_chat_template(messages, tools=tools, tokenize=False,
            **template_kwargs)``).
        input_ids: its tokens, those of ``apply_chat_template(..., tokenize=True)``.
        label_spans: token ranges ``[start, end)`` to train on, in order.
        turn_ends: the token positions just past each complete assistant turn that was found, in
            order: where a sample may be cut between turns (see ``DataConfig.truncation``).
    """

    text: str
    input_ids: list[int]
    label_spans: list[tuple[int, int]]
    turn_ends: list[int]


def _mismatch(what: str, before: str, after: str, at: int, fix: str, example: str) -> TemplateMismatch:
    return TemplateMismatch(
        f"the chat template renders a conversation differently once later turns follow ({what}; they part at "
        f"character {at}: {before[at:at + 40]!r} vs {after[at:at + 40]!r}), as a template that {example} does; "
        f"{fix}")


def assistant_char_spans(tokenizer, messages: Sequence[dict], *, last_only: bool = False,
                         tools: list[dict[str, Any]] | None = None,
                         template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering of ``messages`` and the character spans of its assistant turns.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: normalized messages (:func:`odb.data.formats.normalize`).
        last_only: find the final assistant turn only (``train_on="last"``).
        tools: the record's tools, passed to the template.
        template_kwargs: the template's variables (``DataConfig.chat_template_kwargs``), passed to
            every rendering.

    Returns:
        ``(text, spans)``: ``text`` is ``apply_chat_template(messages, tools=tools, tokenize=False,
        **template_kwargs)``;
        each span ``[start, end)`` of it holds an assistant answer and its end-of-turn token (a turn
        that renders as whitespace only has none).

    Raises:
        TemplateMismatch: the renderings of the prefixes do not extend one another (see the module
            docstring), an assistant turn opens the conversation (no prompt renders before it), or
            the template drops or refuses the system message.
    """
    render = Renderer(tokenizer, messages, tools, template_kwargs)
    turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    fix = "set train_on in the data config to 'all' (labels on every token)" if last_only else _FALLBACKS
    n = len(messages)
    text = whole_rendering(render)
    spans: list[tuple[int, int]] = []
    settled = 0  # text[:settled] is fixed: every later rendering extends it
    prompt = render(turns[0], generation_prompt=True) if turns and turns[0] > 0 else ""
    for i, k in enumerate(turns):
        if k == 0:
            raise TemplateMismatch("the conversation opens with an assistant turn, so no prompt renders before it "
                                   "to tell the answer from the template's own text; start it with a user (or "
                                   "system) turn, or set train_on in the data config to 'all'")
        through = text if k == n - 1 else render(k + 1)
        start = _answer_start(render, k, prompt, through, settled,
                              fix if k != turns[-1] else _last_turn_fix(messages))
        if i + 1 < len(turns):
            following = render(turns[i + 1], generation_prompt=True)
        else:
            following = text if k < n - 1 else render(n, generation_prompt=True)
        end = render.parting(through, following)
        trailer = through[end:]
        if trailer and (not text.endswith(trailer) or not through[start:end].strip() and through[start:].strip()):
            raise _mismatch(f"messages[{k}], an assistant turn, renders differently once "
                            f"{'the conversation goes on' if following is text else 'later turns follow'}",
                            through, following, end, fix,
                            "rewrites past turns (e.g. strips <think> reasoning from earlier assistant turns)")
        answer_end = len(through[:end].rstrip())
        if answer_end > start:
            spans.append((start, answer_end))
        settled, prompt = end, following
    return text, spans


def _answer_start(render: Renderer, k: int, prompt: str, through: str, settled: int, fix: str) -> int:
    """Where the answer of ``messages[k]`` starts in ``through``: where it parts from ``prompt``,
    which must be inside the prompt's generation prompt (then the rest of it is a forced answer
    prefix) and past ``settled``."""
    start = render.parting(prompt, through)
    if start < len(prompt):  # only inside the generation prompt: where render(messages[:k]) ends
        if start < max(render.parting(render(k), prompt), settled):
            raise _mismatch(f"messages[:{k + 1}] parts from messages[:{k}] with the generation prompt before its "
                            "generation prompt", prompt, through, start, fix, "moves or rewrites earlier turns "
                            "(e.g. shows the system message only while a user turn is last)")
    return start


def _last_turn_fix(messages: Sequence[dict]) -> str:
    """The fix where even the final assistant turn cannot be found ('last' would not help)."""
    moved = f", or {FOLD_FIX}" if any(m["role"] == "system" for m in messages) else ""
    return f"set train_on in the data config to 'all' (labels on every token){moved}"


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


def label_runs(tokenizer, input_ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive labelled tokens (``-100``: not a label): what a sample trains on."""
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def encode_chat(tokenizer, messages: Sequence[dict], train_on: str = "assistant",
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> LabelledChat:
    """Renders, tokenizes and labels a conversation.

    Args:
        tokenizer: a fast tokenizer (it gives character offsets) with a chat template.
        messages: normalized messages (:func:`odb.data.formats.normalize`): role, content and the
            fields templates read (``tool_calls``, ``reasoning_content``, ...).
        train_on: one of :data:`TRAIN_ON`. Under ``"all"`` every token is labelled, and the
            assistant turns are still looked for, for ``turn_ends``: where the template
            rewrites past turns there are none.
        tools: the record's tools (``apply_chat_template(..., tools=tools)``).
        template_kwargs: the template's variables (``apply_chat_template(..., **template_kwargs)``),
            the same for every rendering, so that the labels are those of the text trained on.

    Returns:
        The :class:`LabelledChat`.

    Raises:
        TemplateMismatch: see :func:`assistant_char_spans`; under ``"all"`` only where the template
            drops or refuses the system message (or ignores a field, :class:`TemplateDropsFields`).
        ValueError: ``train_on`` is unknown, or the tokenizer gives no offsets.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} gives no character offsets, which odb needs to find the "
                         "assistant tokens; load the model's fast tokenizer (AutoTokenizer, use_fast=True)")
    try:
        text, char_spans = assistant_char_spans(tokenizer, messages, last_only=train_on == "last", tools=tools,
                                                template_kwargs=template_kwargs)
    except TemplateMismatch:
        if train_on != "all":
            raise
        text, char_spans = whole_rendering(Renderer(tokenizer, messages, tools, template_kwargs)), []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    spans = token_spans(encoded["offset_mapping"], char_spans)
    labelled = [(0, len(input_ids))] if train_on == "all" else spans
    return LabelledChat(text, input_ids, labelled, [end for _, end in spans])
