"""Parsing a highlight request: spans, inline markers, validation and limits.

Nothing here touches the model: a request (context, span lists, strength, question) becomes a
:class:`Request` of character ranges, or an :class:`InputError` whose message is written for the
page; :func:`parse_focus_request` does the same for an Auto-highlight request (context,
question, how many passages to pick). :func:`split_prompt` cuts the chat-templated prompt where
the context ends.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvedit.errors import SpanNotFoundError
from kvedit.prompts import QUESTION_SEPARATOR, split_user_message, templated_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "QUESTION_SEPARATOR",
    "FocusRequest",
    "InputError",
    "Limits",
    "Marked",
    "PromptSplit",
    "Range",
    "Request",
    "locate",
    "overlap",
    "parse_focus_request",
    "parse_request",
    "span_lines",
    "split_prompt",
    "strip_markers",
]

Range = tuple[int, int]
"""A character range ``(start, end)``, end excluded."""

_MARKER = re.compile(r"\[\[(.*?)\]\]|\{\{(.*?)\}\}", re.DOTALL)
_STRAY_MARKER = re.compile(r"\[\[|\]\]|\{\{|\}\}")


class InputError(ValueError):
    """A request the app refuses. The message is written for the page, not for a log."""


@dataclass(frozen=True)
class Limits:
    """Input size limits (a CPU answers a 1,500-token context in a few seconds).

    Attributes:
        max_context_chars: characters of the context, markers removed.
        max_context_tokens: tokens of the captured prompt (chat template and context).
        max_question_chars: characters of the question.
        max_spans: spans per request (listed and inline, emphasized and suppressed).
        max_strength: the largest strength in nats.
        max_new_tokens: tokens generated per answer.
    """

    max_context_chars: int = 12_000
    max_context_tokens: int = 1_536
    max_question_chars: int = 500
    max_spans: int = 32
    max_strength: float = 10.0
    max_new_tokens: int = 48


@dataclass(frozen=True)
class Marked:
    """A context with its inline markers removed.

    Attributes:
        context: the text without ``[[``/``]]``/``{{``/``}}``.
        emphasize: character ranges in ``context`` that were marked ``[[...]]``.
        suppress: character ranges in ``context`` that were marked ``{{...}}``.
    """

    context: str
    emphasize: tuple[Range, ...]
    suppress: tuple[Range, ...]


@dataclass(frozen=True)
class Request:
    """A validated request.

    Attributes:
        context: the context, markers removed.
        emphasize: character ranges of ``context`` to emphasize (listed and inline spans).
        suppress: character ranges of ``context`` to suppress.
        strength: nats, in ``[0, Limits.max_strength]``.
        question: the question, stripped.
    """

    context: str
    emphasize: tuple[Range, ...]
    suppress: tuple[Range, ...]
    strength: float
    question: str


@dataclass(frozen=True)
class FocusRequest:
    """A validated Auto-highlight request.

    Attributes:
        context: the context, markers removed (what the model reads).
        question: the question, stripped.
        top_k: how many passages to pick (at least 1).
    """

    context: str
    question: str
    top_k: int


@dataclass(frozen=True)
class PromptSplit:
    """The chat-templated prompt, cut where the context ends.

    Attributes:
        prefix: the text to capture (template header and context).
        continuation: the question, the end of the user turn and the assistant header.
        context_start: where the context starts in ``prefix``; it ends at ``len(prefix)``.
    """

    prefix: str
    continuation: str
    context_start: int

    def shift(self, ranges: Sequence[Range]) -> list[Range]:
        """Character ranges of the context as ranges of :attr:`prefix`."""
        return [(a + self.context_start, b + self.context_start) for a, b in ranges]


def _excerpt(text: str, at: int, width: int = 30) -> str:
    """A short quoted excerpt of ``text`` around character ``at`` for messages."""
    lo, hi = max(0, at - width), min(len(text), at + width)
    snippet = text[lo:hi].replace("\n", " ")
    return f"“{'…' if lo else ''}{snippet}{'…' if hi < len(text) else ''}”"


def strip_markers(text: str) -> Marked:
    """Remove inline ``[[emphasize]]`` and ``{{suppress}}`` markers, keeping where they were.

    Raises:
        InputError: a marker without its pair, nested markers, or an empty marked span.
    """
    parts: list[str] = []
    emphasize: list[Range] = []
    suppress: list[Range] = []
    length = 0
    last = 0

    def plain(piece: str, offset: int) -> None:
        stray = _STRAY_MARKER.search(piece)
        if stray:
            raise InputError(
                f"Unmatched `{stray.group()}` near {_excerpt(text, offset + stray.start())}: "
                "inline markers come in pairs, `[[like this]]` to emphasize and "
                "`{{like this}}` to suppress."
            )

    for match in _MARKER.finditer(text):
        before = text[last : match.start()]
        plain(before, last)
        parts.append(before)
        length += len(before)
        is_emphasis = match.group(1) is not None
        inner = match.group(1) if is_emphasis else match.group(2)
        if _STRAY_MARKER.search(inner):
            raise InputError(
                f"Nested markers near {_excerpt(text, match.start())}: a span is marked "
                "either `[[...]]` or `{{...}}`, once."
            )
        if not inner.strip():
            raise InputError(f"Empty marked span near {_excerpt(text, match.start())}.")
        (emphasize if is_emphasis else suppress).append((length, length + len(inner)))
        parts.append(inner)
        length += len(inner)
        last = match.end()
    plain(text[last:], last)
    parts.append(text[last:])
    return Marked("".join(parts), tuple(emphasize), tuple(suppress))


def span_lines(text: str | None) -> list[str]:
    """The spans of a one-span-per-line text box (stripped; blank lines skipped)."""
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def locate(context: str, spans: Sequence[str], action: str) -> list[Range]:
    """Every occurrence of each span in ``context``, as character ranges.

    Raises:
        InputError: some span does not occur in the context (all missing ones are named).
    """
    ranges: list[Range] = []
    missing: list[str] = []
    for span in spans:
        found = [(m.start(), m.end()) for m in re.finditer(re.escape(span), context)]
        if not found:
            missing.append(span)
        ranges.extend(found)
    if missing:
        shown = "; ".join(f"“{s[:80]}{'…' if len(s) > 80 else ''}”" for s in missing)
        noun = "Span" if len(missing) == 1 else "Spans"
        raise InputError(
            f"{noun} to {action} not found in the context: {shown}. A span must appear in the "
            "context exactly (case, spaces and punctuation count)."
        )
    return ranges


def overlap(a: Sequence[Range], b: Sequence[Range]) -> Range | None:
    """The first overlap of a range of ``a`` with a range of ``b``, or ``None``."""
    for a0, a1 in a:
        for b0, b1 in b:
            if a0 < b1 and b0 < a1:
                return max(a0, b0), min(a1, b1)
    return None


def box_text(value: object, what: str) -> str:
    """The text of an input box: ``value`` itself when a str, ``""`` for ``None`` (an empty
    box, as an API caller may send it).

    Raises:
        InputError: ``value`` is anything else (a number, a list...); ``what`` names the box.
    """
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"The {what} must be text, not {type(value).__name__} ({value!r:.40}).")
    return value


def _context_and_question(context: str, question: str, lim: Limits) -> tuple[Marked, str]:
    """The context without its markers and the stripped question, both checked.

    Raises:
        InputError: an empty or too long context or question, one that is not text, or bad
            markers.
    """
    context, question = box_text(context, "context"), box_text(question, "question")
    if not context.strip():
        raise InputError("The context is empty: paste a text or load a sample.")
    marked = strip_markers(context)
    if len(marked.context) > lim.max_context_chars:
        raise InputError(
            f"The context is too long: {len(marked.context):,} characters "
            f"(max {lim.max_context_chars:,})."
        )
    question = question.strip()
    if not question:
        raise InputError("Ask a question about the context.")
    if len(question) > lim.max_question_chars:
        raise InputError(
            f"The question is too long: {len(question):,} characters "
            f"(max {lim.max_question_chars:,})."
        )
    return marked, question


def parse_request(
    context: str,
    emphasize: str,
    suppress: str,
    strength: float | str,
    question: str,
    limits: Limits | None = None,
) -> Request:
    """Validate a request.

    Args:
        context: the text; ``[[...]]`` marks a span to emphasize, ``{{...}}`` one to suppress.
        emphasize: spans to emphasize, one per line (every occurrence in the context counts).
        suppress: spans to suppress, one per line.
        strength: nats (anything ``float`` accepts).
        question: asked after the context.
        limits: the size limits (default :class:`Limits`).

    Raises:
        InputError: with a message for the page.
    """
    lim = limits or Limits()
    marked, question = _context_and_question(context, question, lim)
    try:
        nats = float(strength)
    except (TypeError, ValueError):
        raise InputError(f"Strength must be a number of nats, not {strength!r}.") from None
    if not math.isfinite(nats) or not 0 <= nats <= lim.max_strength:
        raise InputError(f"Strength must be between 0 and {lim.max_strength:g} nats.")
    listed_emph = span_lines(box_text(emphasize, "Emphasize box"))
    listed_supp = span_lines(box_text(suppress, "Suppress box"))
    n_spans = len(listed_emph) + len(listed_supp) + len(marked.emphasize) + len(marked.suppress)
    if n_spans == 0:
        raise InputError(
            "Mark at least one span: list it under Emphasize or Suppress, select it in the "
            "context and press a button, or write `[[span]]` / `{{span}}` in the context."
        )
    if n_spans > lim.max_spans:
        raise InputError(f"Too many spans: {n_spans} (max {lim.max_spans}).")
    emph = [*marked.emphasize, *locate(marked.context, listed_emph, "emphasize")]
    supp = [*marked.suppress, *locate(marked.context, listed_supp, "suppress")]
    both = overlap(emph, supp)
    if both:
        raise InputError(
            f"“{marked.context[both[0] : both[1]][:80]}” is marked both to emphasize and to "
            "suppress; a token can only be one."
        )
    return Request(marked.context, tuple(emph), tuple(supp), nats, question)


def parse_focus_request(
    context: str, question: str, top_k: int | float | str = 1, limits: Limits | None = None
) -> FocusRequest:
    """Validate an Auto-highlight request (context and question as for :func:`parse_request`).

    ``top_k`` is how many passages to pick: a whole number from 1 to ``limits.max_spans``.

    Raises:
        InputError: with a message for the page.
    """
    lim = limits or Limits()
    marked, question = _context_and_question(context, question, lim)
    try:
        k = float(top_k)
    except (TypeError, ValueError):
        k = math.nan
    if not math.isfinite(k) or k != int(k) or not 1 <= k <= lim.max_spans:
        raise InputError(
            f"Passages to pick must be a whole number from 1 to {lim.max_spans}, not {top_k!r}."
        )
    return FocusRequest(marked.context, question, int(k))


def split_prompt(tokenizer: PreTrainedTokenizerBase, context: str, question: str) -> PromptSplit:
    """Template ``context + QUESTION_SEPARATOR + question`` and cut it after the context
    (:func:`kvedit.prompts.split_user_message`, as the evaluation suite's
    :func:`kvedit.evals.methods.split_prompt` does for an example). Unlike the evaluation
    suite, a template that rewrote the message is not an error: the plain message is cut."""
    user = context + QUESTION_SEPARATOR + question
    try:
        return PromptSplit(
            *split_user_message(templated_prompt(tokenizer, user), user, len(context))
        )
    except SpanNotFoundError:  # the template rewrote the message: fall back to the plain text
        return PromptSplit(*split_user_message(user, user, len(context)))
