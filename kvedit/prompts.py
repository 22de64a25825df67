"""Prompt formats: the two ways a user message becomes a prompt (:data:`PROMPT_FORMATS`: the
tokenizer's chat template, or the message and :data:`ANSWER_CUE` for a base model), and that
prompt cut where the question starts (to capture the context and ask on top of it).

The convention: a user message that asks about a context is ``context + QUESTION_SEPARATOR +
question`` (``"...\\n\\nQuestion: ..."``), and the prompt is cut at :data:`QUESTION_MARK`, the
separator less its trailing space, so the captured cache holds the context and the continuation
starts with the question's blank line.
"""

from __future__ import annotations

from . import checks
from .errors import SpanNotFoundError

__all__ = [
    "ANSWER_CUE",
    "PROMPT_FORMATS",
    "QUESTION_LABEL",
    "QUESTION_MARK",
    "QUESTION_SEPARATOR",
    "chat_prefix",
    "plain_answer",
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

PROMPT_FORMATS = ("chat", "plain")
"""How a user message becomes the prompt (the evaluation suite's
:func:`kvedit.evals.methods.context.split_prompt`, vLLM's
:func:`kvedit.integrations.vllm.contexts.publish_context`):

- ``"chat"``: the tokenizer's chat template, one user turn and the generation prompt (for
  instruct models; a tokenizer without a chat template is an error, never a silent fallback);
- ``"plain"``: the user message followed by :data:`ANSWER_CUE` (for base models).

Which one a run uses by default is the model's, :func:`kvedit.models.default_prompt`."""

ANSWER_CUE = "\nAnswer:"
"""What the ``"plain"`` format puts after the user message, so a base model continues
``"Question: ...\\nAnswer:"`` with the answer."""


def plain_answer(text: str) -> str:
    """The answer a ``"plain"`` prompt gets: the generation's first non-empty line.

    A base model answers after :data:`ANSWER_CUE`, then goes on writing more questions and
    answers of its own (``" 6451\nQuestion: ...\nAnswer: 3044"``); the metrics would read the
    numbers it invented as part of the answer. Greedy decoding makes this the same as stopping
    at the first newline."""
    stripped = text.lstrip()
    return text[: len(text) - len(stripped)] + stripped.split("\n", 1)[0]


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
