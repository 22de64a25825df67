"""Prompt formats: a user message in the tokenizer's chat template, and that prompt cut where the
question starts (to capture the context and ask on top of it).

The convention: a user message that asks about a context is ``context + QUESTION_SEPARATOR +
question`` (``"...\\n\\nQuestion: ..."``), and the prompt is cut at :data:`QUESTION_MARK`, the
separator less its trailing space, so the captured cache holds the context and the continuation
starts with the question's blank line.
"""

from __future__ import annotations

from . import checks
from .errors import SpanNotFoundError

__all__ = [
    "QUESTION_LABEL",
    "QUESTION_MARK",
    "QUESTION_SEPARATOR",
    "chat_prefix",
    "split_user_message",
    "templated_prompt",
]

QUESTION_LABEL = "Question: "
"""What opens the question in a user message (after a blank line when something precedes it)."""
QUESTION_SEPARATOR = "\n\n" + QUESTION_LABEL
"""Put between the context and the question in a user message: ``"\\n\\nQuestion: "``."""
QUESTION_MARK = QUESTION_SEPARATOR.rstrip(" ")
"""Where a prompt is cut to capture its context (:func:`chat_prefix`): ``"\\n\\nQuestion:"``.
A context holding it cannot be cut there, so callers refuse such a context."""


def templated_prompt(tokenizer, user_message: str) -> str:
    """``user_message`` in the tokenizer's chat template (as is when it has none).

    The tokenizer's BOS text is left out when the tokenizer adds BOS itself, so capturing the
    result does not double it.
    """
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
        )
    else:
        full = user_message
    bos = getattr(tokenizer, "bos_token", None)
    if bos and full.startswith(bos):
        probe = tokenizer("x")["input_ids"]
        if probe and probe[0] == tokenizer.bos_token_id:
            full = full[len(bos) :]
    return full


def chat_prefix(tokenizer, user_message: str, split_at: str) -> tuple[str, str]:
    """Cut the chat-templated prompt of ``user_message`` where ``split_at`` first occurs.

    Returns ``(prefix, continuation)`` texts, e.g. to capture a document and ask about it
    afterwards: ``capture(model, tok, prefix).generate(continuation)``.
    """
    split_at = checks.text("split_at", split_at, allow_empty=False)
    full = templated_prompt(tokenizer, user_message)
    cut = full.find(split_at)
    if cut < 0:
        raise SpanNotFoundError(f"split_at {split_at!r} not found in the templated prompt {full!r}")
    return full[:cut], full[cut:]


def split_user_message(full: str, user_message: str, end: int) -> tuple[str, str, int]:
    """``full`` (a prompt holding ``user_message`` verbatim) cut after the first ``end``
    characters of the user message (its context, say).

    Returns ``(prefix, continuation, start)``: the text up to the cut, the rest, and where the
    user message starts in ``full``. Raises :class:`~kvedit.errors.SpanNotFoundError` when
    ``full`` does not hold ``user_message`` (a chat template that rewrote it).
    """
    start = full.find(user_message)
    if start < 0:
        raise SpanNotFoundError(f"the prompt does not hold the user message {user_message!r}")
    cut = start + end
    return full[:cut], full[cut:], start
