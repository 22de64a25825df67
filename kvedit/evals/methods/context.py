"""The per-example context every method answers from.

An :class:`ExampleContext` builds the chat-templated prompt, captures the cache of the
documents once (shared by every method on that example) and knows where each document sits
in the captured text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvedit.evals.schema import Example
from kvedit.state import KVState, capture, templated_prompt

__all__ = ["ExampleContext", "split_prompt"]


def split_prompt(tokenizer, example: Example) -> tuple[str, str, list[tuple[int, int]]]:
    """``(prefix, continuation, document spans)`` of an example's chat-templated prompt.

    The prefix ends where the documents end (the captured context); the continuation asks the
    question and opens the answer. Spans are character ranges of the documents in the prefix.
    """
    user = example.user_message()
    full = templated_prompt(tokenizer, user)
    start = full.find(user)
    if start < 0:  # the template rewrote the message; fall back to the raw text
        full, start = user, 0
    cut = start + example.documents_end()
    spans = [(start + a, start + b) for a, b in example.document_spans()]
    return full[:cut], full[cut:], spans


@dataclass
class ExampleContext:
    """Everything a method needs for one example; the capture is made once and shared.

    ``notes`` holds what is computed once per example (:meth:`memo`: the attention shares
    ``auto`` and ``reread`` share) and what methods leave for inspection (``"auto_choice"``,
    ``"auto_strengths"``, ``"blend_report"``).
    """

    model: object
    tokenizer: object
    example: Example
    max_new_tokens: int = 32
    notes: dict[str, Any] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def _split(self) -> tuple[str, str, list[tuple[int, int]]]:
        return split_prompt(self.tokenizer, self.example)

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
        return self.prefix + self.continuation

    @functools.cached_property
    def state(self) -> KVState:
        """The captured cache of :attr:`prefix` (never mutated by methods)."""
        return capture(self.model, self.tokenizer, self.prefix)

    def gold_span(self) -> tuple[int, int]:
        return self.doc_spans[self.example.gold_index]

    def generate_prompt(self, example: Example) -> str:
        """Answer another variant of the example from scratch (baselines)."""
        prefix, cont, _ = split_prompt(self.tokenizer, example)
        return capture(self.model, self.tokenizer, prefix).generate(cont, self.max_new_tokens)

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """Compute ``fn()`` once per example (e.g. document scores shared by auto and reread)."""
        if key not in self.notes:
            self.notes[key] = fn()
        return self.notes[key]
