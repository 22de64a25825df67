"""Spans: which tokens of a text an edit touches.

A span is a substring (every occurrence counts), a compiled regular expression (every match), or
a ``(start, end)`` character range. A token belongs to a span when its character range overlaps
the span at all. Zero-width tokens (BOS, other special tokens) never overlap anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch

from .errors import SpanNotFoundError

Span = str | re.Pattern | tuple[int, int]
Spans = Span | Sequence[Span]

_PREVIEW = 300


def _preview(text: str) -> str:
    if len(text) <= _PREVIEW:
        return repr(text)
    half = _PREVIEW // 2
    return repr(text[:half]) + f" ... ({len(text)} chars) ... " + repr(text[-half:])


def as_span_list(spans: Spans) -> list[Span]:
    """Normalise one span or a sequence of spans into a list, validating each."""
    if isinstance(spans, (str, re.Pattern)):
        items: list = [spans]
    elif (
        isinstance(spans, tuple)
        and len(spans) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in spans)
    ):
        items = [spans]
    else:
        items = list(spans)
    for span in items:
        if isinstance(span, str):
            if not span:
                raise ValueError("empty span: a span must be a non-empty string")
        elif isinstance(span, re.Pattern):
            if not span.pattern:
                raise ValueError("empty span: the regular expression is empty")
        elif isinstance(span, tuple) and len(span) == 2:
            start, end = span
            if not (isinstance(start, int) and isinstance(end, int)) or start >= end or start < 0:
                raise ValueError(f"bad character range {span!r}: need 0 <= start < end")
        else:
            raise TypeError(
                f"a span is a str, a compiled regex or a (start, end) tuple, not {span!r}"
            )
    return items


def char_ranges(text: str, spans: Spans) -> list[tuple[int, int]]:
    """The character ranges of ``spans`` in ``text``; raises :class:`SpanNotFoundError`."""
    out: list[tuple[int, int]] = []
    for span in as_span_list(spans):
        if isinstance(span, str):
            found = [(m.start(), m.start() + len(span)) for m in re.finditer(re.escape(span), text)]
            if not found:
                raise SpanNotFoundError(f"span {span!r} not found in the text: {_preview(text)}")
            out.extend(found)
        elif isinstance(span, re.Pattern):
            found = [(m.start(), m.end()) for m in span.finditer(text) if m.end() > m.start()]
            if not found:
                raise SpanNotFoundError(
                    f"pattern {span.pattern!r} matches nothing in the text: {_preview(text)}"
                )
            out.extend(found)
        else:
            start, end = span
            if end > len(text):
                raise SpanNotFoundError(
                    f"character range {span!r} is outside the text ({len(text)} chars): "
                    f"{_preview(text)}"
                )
            out.append((start, end))
    return out


def tokens_in_ranges(offsets: torch.Tensor, ranges: Iterable[tuple[int, int]]) -> torch.Tensor:
    """Indices of tokens whose ``[start, end)`` overlaps any range.

    Args:
        offsets: ``[n_tokens, 2]`` character offsets.
        ranges: character ranges.

    Returns:
        Sorted unique token indices, ``LongTensor[k]``.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    hit = torch.zeros(offsets.shape[0], dtype=torch.bool)
    for a, b in ranges:
        hit |= (starts < b) & (ends > a) & (ends > starts)
    return hit.nonzero().flatten()


def token_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, torch.Tensor]:
    """Decode ``ids`` and give each token's character range in the decoded text.

    Returns ``(text, offsets [n, 2])``. Special tokens are kept in the text and get zero-width
    ranges at their place, so spans never select them.
    """
    ids = [int(i) for i in ids]
    special = set(tokenizer.all_special_ids)
    text_parts: list[str] = []
    offsets = torch.zeros(len(ids), 2, dtype=torch.long)
    pos = 0
    # Decode runs of ordinary tokens together (multi-byte characters can span tokens), and give
    # each token the growth of the decoded run when it is added.
    run: list[int] = []
    run_text = ""
    run_start = 0

    def flush() -> None:
        nonlocal pos, run, run_text
        text_parts.append(run_text)
        pos = run_start + len(run_text)
        run, run_text = [], ""

    for i, tid in enumerate(ids):
        if tid in special:
            if run:
                flush()
            piece = tokenizer.decode([tid], skip_special_tokens=False)
            offsets[i] = torch.tensor([pos, pos])
            text_parts.append(piece)
            pos += len(piece)
            continue
        if not run:
            run_start = pos
        run.append(tid)
        new_text = tokenizer.decode(
            run, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        offsets[i] = torch.tensor([run_start + len(run_text), run_start + len(new_text)])
        run_text = new_text
        if len(run) >= 256:  # bound the quadratic re-decoding; boundaries rarely split chars
            flush()
    if run:
        flush()
    return "".join(text_parts), offsets
