"""Prompt formats: a user message in the tokenizer's chat template, and that prompt cut where the
question starts (to capture the context and ask on top of it)."""

from __future__ import annotations

from . import checks
from .errors import SpanNotFoundError

__all__ = ["chat_prefix", "templated_prompt"]


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
