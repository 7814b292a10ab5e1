"""A conversation rendered with the tokenizer's chat template, and the checks of its whole rendering.

:class:`Renderer` renders a conversation's prefixes (each with the record's tools and the same
template variables, ``DataConfig.chat_template_kwargs``) and finds where two renderings part;
:mod:`odb.data.labels` finds the assistant turns with it. :func:`whole_rendering` renders the whole
conversation and raises :class:`TemplateMismatch` where no rendering of it would train on what the
record holds: a template that drops the system message (Mistral v0.3's, Mistral-Nemo's, once an
assistant turn is last) or refuses it (Gemma 2's raises) names ``system_message: fold``; one that
renders the conversation the same without a tool call, a tool result, the tools offered or the
final answer's reasoning raises :class:`TemplateDropsFields`, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from odb.data.formats import fold_system_messages

__all__ = ["FOLD_FIX", "Renderer", "TemplateDropsFields", "TemplateMismatch", "whole_rendering"]


class TemplateMismatch(ValueError):
    """The chat template's renderings of a conversation's prefixes do not extend one another (or it
    drops the system message), so its assistant turns cannot be found in the full rendering. The
    message says where and names the fix."""


class TemplateDropsFields(TemplateMismatch):
    """The chat template renders the conversation the same without a field the record gives (a tool
    call, a tool result, the tools offered, the final answer's reasoning): a template without tool or
    reasoning support, which would train a tool call as an empty answer. The message names the field."""


class Renderer:
    """Renders prefixes of one conversation, and finds where two renderings part."""

    def __init__(self, tokenizer, messages: Sequence[dict], tools: list[dict[str, Any]] | None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer, self.messages, self.tools = tokenizer, list(messages), tools
        self.template_kwargs = dict(template_kwargs or {})  # (every rendering gets them: text and labels agree)
        self._added: list[str] | None = None

    def render(self, messages: Sequence[dict], *, tools: bool = True, generation_prompt: bool = False) -> str:
        """``messages`` rendered by the template, with the tools (unless ``tools`` is False) and the
        template's variables."""
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools if tools else None, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.template_kwargs)

    def __call__(self, end: int, *, generation_prompt: bool = False) -> str:
        """``messages[:end]`` rendered (with the generation prompt after them)."""
        return self.render(self.messages[:end], generation_prompt=generation_prompt)

    def replaced(self, k: int, message: dict[str, Any] | None = None, *, tools: bool = True) -> str:
        """The whole conversation rendered with ``messages[k]`` replaced by ``message`` (k < 0: none
        replaced), and without the tools where ``tools`` is False."""
        messages = [*self.messages[:k], message, *self.messages[k + 1:]] if k >= 0 else self.messages
        return self.render(messages, tools=tools)

    def parting(self, a: str, b: str) -> int:
        """Where ``a`` and ``b`` part: ``len(a)`` if ``b`` extends ``a``; else the end of their common
        prefix, moved back so that it falls inside no added token of either."""
        if b.startswith(a):
            return len(a)
        at = _common_prefix(a, b)
        if self._added is None:
            self._added = [t for t in self.tokenizer.get_added_vocab() if len(t) > 1]
        moved = True
        while moved and at > 0:
            moved = False
            for text in (a, b):
                for token in self._added:
                    start = text.rfind(token, max(0, at - len(token) + 1), at + len(token) - 1)
                    if start != -1 and start < at:
                        at, moved = start, True
        return at


def _common_prefix(a: str, b: str) -> int:
    low, high = 0, min(len(a), len(b))
    while low < high:  # a[:low] == b[:low]; a[:high + 1] != b[:high + 1]
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


FOLD_FIX = ("set system_message to 'fold' in the data config (--system_message fold): the system text then opens "
            "the user turn after it")


def whole_rendering(render: Renderer) -> str:
    """The whole conversation rendered, checked: the template takes its system message, keeps it in
    the rendering, and reads every field the record gives (:func:`_check_fields_kept`)."""
    try:
        text = render(len(render.messages))
    except Exception as err:  # noqa: BLE001 - a template's raise_exception (e.g. "System role not supported")
        _check_system_taken(render, err)
        raise
    _check_system_kept(render.messages, text)
    _check_fields_kept(render, text)
    return text


def _check_system_taken(render: Renderer, err: Exception) -> None:
    """Raises :class:`TemplateMismatch` naming ``system_message: fold`` where the template refuses
    the conversation (``err``) with its system messages but renders it with them folded."""
    if not any(message["role"] == "system" for message in render.messages):
        return
    try:
        render.render(fold_system_messages(render.messages))
    except Exception:  # noqa: BLE001 - it refuses the conversation for another reason: err says which
        return
    raise TemplateMismatch(f"the chat template refuses this conversation's system message ({type(err).__name__}: "
                           f"{err}), as Gemma 2's does; {FOLD_FIX}, or drop the system message") from None


def _check_system_kept(messages: Sequence[dict], text: str) -> None:
    for message in messages:
        content = message.get("content")
        if message["role"] == "system" and isinstance(content, str) and content.strip() \
                and content.strip() not in text:
            raise TemplateMismatch(
                f"the chat template drops the system message ({content.strip()[:40]!r}) from this conversation's "
                "rendering (e.g. Mistral v0.3's and Mistral-Nemo's show it only inside the last user turn while "
                f"that turn is last), so no rendering of it trains with the system prompt; {FOLD_FIX}, drop the "
                "system message, or use a template that renders it in place")


_REASONING = ("reasoning_content", "thinking", "reasoning")


def _check_fields_kept(render: Renderer, text: str) -> None:
    """Raises :class:`TemplateDropsFields` where the whole rendering ``text`` stays the same without a
    field the record gives: an assistant turn's tool calls, a tool turn's result, the tools offered,
    or the final assistant turn's reasoning (earlier turns' reasoning a template may drop by design,
    as Qwen3's does). One more rendering per such field; records without them cost nothing."""
    messages = render.messages
    last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    probes: list[tuple[str, int, dict[str, Any] | None]] = []
    for k, message in enumerate(messages):
        if message.get("tool_calls"):
            probes.append((f"the tool calls of messages[{k}]", k,
                           {key: value for key, value in message.items() if key != "tool_calls"}))
        if message["role"] == "tool":
            probes.append((f"the tool result messages[{k}]", k, {**message, "content": f"{message['content']} #"}))
        if k == last and any(message.get(key) for key in _REASONING):
            probes.append((f"the reasoning of messages[{k}]", k,
                           {key: value for key, value in message.items() if key not in _REASONING}))
    if render.tools:
        probes.append(("the tools offered", -1, None))
    for what, k, changed in probes:
        try:
            probe = render.replaced(k, changed, tools=changed is not None)
        except Exception:  # noqa: BLE001 - the template refuses the conversation without it: it reads the field
            continue
        if probe == text:
            raise TemplateDropsFields(
                f"the chat template renders this conversation the same without {what}: it has no support for "
                "them, and training on its rendering would teach the model to answer without them (a tool call "
                "as an empty answer); use the model's own tool-calling / reasoning template (--tokenizer), or "
                "drop those fields or turns from the data")
