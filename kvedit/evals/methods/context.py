"""The per-example context every method answers from.

An :class:`ExampleContext` builds the prompt (in the ``"chat"`` or ``"plain"`` format, see
:data:`kvedit.evals.prompts.PROMPT_FORMATS`), captures the cache of the documents once (shared
by every method on that example) and knows where each document sits in the captured text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvedit.errors import InvalidInputError, SpanNotFoundError
from kvedit.evals.prompts import ANSWER_CUE, PROMPT_FORMATS
from kvedit.evals.schema import Example
from kvedit.prompts import split_user_message, templated_prompt
from kvedit.states.capturing import capture
from kvedit.states.state import KVState

__all__ = ["ExampleContext", "check_prompt", "format_prompt", "split_prompt"]


def check_prompt(tokenizer, prompt: str) -> str:
    """``prompt`` if ``tokenizer`` can be prompted in that format; else InvalidInputError.

    An unknown format, and ``"chat"`` with a tokenizer that has no chat template, are errors
    (``"plain"`` is never chosen silently instead).
    """
    if prompt not in PROMPT_FORMATS:
        raise InvalidInputError(
            f"unknown prompt format {prompt!r}; choose one of {', '.join(PROMPT_FORMATS)}"
        )
    if prompt == "chat" and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise InvalidInputError(
            f"prompt format 'chat' needs a chat template, and the tokenizer {name!r} has none; "
            "use the 'plain' format (kvedit eval litm --prompt plain) for a base model"
        )
    return prompt


def format_prompt(tokenizer, user_message: str, prompt: str = "chat") -> str:
    """The full prompt text of ``user_message`` in the format ``prompt``.

    ``"chat"``: :func:`kvedit.prompts.templated_prompt` (the chat template with one user turn and
    the generation prompt); ``"plain"``: ``user_message + ANSWER_CUE``. Either way the BOS text
    is left out when the tokenizer adds BOS itself (capturing adds it).
    """
    check_prompt(tokenizer, prompt)
    if prompt == "chat":
        return templated_prompt(tokenizer, user_message)
    return user_message + ANSWER_CUE


def split_prompt(
    tokenizer, example: Example, prompt: str = "chat"
) -> tuple[str, str, list[tuple[int, int]]]:
    """``(prefix, continuation, document spans)`` of an example's prompt in format ``prompt``.

    The prefix ends where the documents end (the captured context); the continuation asks the
    question and opens the answer (it contains ``example.question``). Spans are character
    ranges of the documents in the prefix. A chat template that does not keep the user
    message verbatim is an error. The cut is :func:`kvedit.prompts.split_user_message`'s (as
    in the highlight app's ``split_prompt`` for a context and a question).
    """
    user = example.user_message()
    full = format_prompt(tokenizer, user, prompt)
    try:
        prefix, continuation, start = split_user_message(full, user, example.documents_end())
    except SpanNotFoundError:
        raise InvalidInputError(
            f"example {example.id!r}: the chat template rewrote the user message, so the "
            "documents cannot be located in the prompt; use the 'plain' prompt format"
        ) from None
    spans = [(start + a, start + b) for a, b in example.document_spans()]
    return prefix, continuation, spans


@dataclass
class ExampleContext:
    """Everything a method needs for one example; the capture is made once and shared.

    ``prompt_format`` is ``"chat"`` or ``"plain"`` (:func:`split_prompt`); :attr:`prompt` is
    the full prompt text in that format.

    ``notes`` holds what is computed once per example (:meth:`memo`: the attention shares
    ``auto`` and ``reread`` share) and what methods leave for inspection (``"auto_choice"``,
    ``"auto_strengths"``, ``"blend_report"``, ``"cache_bytes"``).
    """

    model: object
    tokenizer: object
    example: Example
    max_new_tokens: int = 32
    prompt_format: str = "chat"
    notes: dict[str, Any] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def _split(self) -> tuple[str, str, list[tuple[int, int]]]:
        return split_prompt(self.tokenizer, self.example, self.prompt_format)

    @property
    def prefix(self) -> str:
        return self._split[0]

    @property
    def continuation(self) -> str:
        return self._split[1]

    @property
    def doc_spans(self) -> list[tuple[int, int]]:
        """Character range of each document in :attr:`prefix` (and in the full prompt)."""
        return self._split[2]

    @property
    def prompt(self) -> str:
        """The full prompt: :attr:`prefix` + :attr:`continuation`."""
        return self.prefix + self.continuation

    @functools.cached_property
    def state(self) -> KVState:
        """The captured cache of :attr:`prefix` (never mutated by methods)."""
        return capture(self.model, self.tokenizer, self.prefix)

    def gold_span(self) -> tuple[int, int]:
        return self.doc_spans[self.example.gold_index]

    def generate_prompt(self, example: Example) -> str:
        """Answer another variant of the example from scratch (baselines)."""
        prefix, cont, _ = split_prompt(self.tokenizer, example, self.prompt_format)
        return capture(self.model, self.tokenizer, prefix).generate(cont, self.max_new_tokens)

    def compressed(self, state: KVState) -> KVState:
        """Note ``state``'s bytes as a fraction of the full capture's (``notes["cache_bytes"]``,
        which the run records as ``"bytes"``); returns ``state``. Compression methods call it on
        the state they answer from."""
        self.notes["cache_bytes"] = state.nbytes / self.state.nbytes
        return state

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """Compute ``fn()`` once per example (e.g. document scores shared by auto and reread)."""
        if key not in self.notes:
            self.notes[key] = fn()
        return self.notes[key]
