"""Passages: a captured text cut into the pieces :func:`kvedit.focus` scores.

A splitter cuts a region of ``state.text`` into character ranges: ``"paragraphs"`` (blank
lines), ``"lines"``, ``"sentences"`` (after ``.``, ``!`` or ``?`` and at line breaks), or an
int ``n`` (windows of ``n`` tokens). The default (``None``) cuts paragraphs, cuts every
multi-line paragraph into its lines and every piece over :data:`MAX_PASSAGE_TOKENS` tokens into
sentences, so ``"instruction\\n\\nrecord\\nrecord"`` gives the instruction and one passage per
record. Pieces are trimmed of whitespace and whitespace-only pieces are dropped. Chat-template
text (a special token, and the rest of its line, e.g. ``<|im_start|>user``) is never part of a
passage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .. import checks
from ..errors import EmptySelectionError, InvalidInputError
from ..spans import as_span_list, char_ranges, tokens_in_ranges
from ..states.state import KVState

__all__ = ["MAX_PASSAGE_TOKENS", "SPLITTERS", "outside_passages", "split_passages"]

SPLITTERS = ("paragraphs", "lines", "sentences")
"""The splitter names :func:`split_passages` knows."""
MAX_PASSAGE_TOKENS = 200
"""The default splitter cuts a passage with more tokens than this into sentences."""

_BOUNDARIES = {
    "paragraphs": re.compile(r"\n[^\S\n]*\n\s*"),
    "lines": re.compile(r"\n"),
    "sentences": re.compile(r"(?<=[.!?])\s+|\n"),
}

Range = tuple[int, int]


def outside_passages(text: str, passages: Sequence[Range]) -> str:
    """``text`` without its ``passages`` (character ranges), each cut replaced by a line
    break: the prompt's own frame (instruction, headers, chat template)."""
    out, start = [], 0
    for a, b in sorted(passages):
        if a > start:
            out.append(text[start:a])
        start = max(start, b)
    out.append(text[start:])
    return "\n".join(out)


def _special_strings(tokenizer) -> list[str]:
    if tokenizer is None:
        return []
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            names.add(added.content)
    return sorted((n for n in names if n), key=len, reverse=True)


def template_ranges(text: str, tokenizer) -> list[Range]:
    """Character ranges of chat-template text: each special token and the rest of its line."""
    specials = _special_strings(tokenizer)
    if not specials:
        return []
    out = []
    for m in re.finditer("|".join(map(re.escape, specials)), text):
        end = text.find("\n", m.end())
        out.append((m.start(), len(text) if end < 0 else end))
    return out


def _segments(text: str, region: Range, template: list[Range]) -> list[Range]:
    """``region`` minus the template ranges, as ordered pieces."""
    lo, hi = region
    out, start = [], lo
    for a, b in sorted(template):
        if b <= start or a >= hi:
            continue
        if a > start:
            out.append((start, a))
        start = max(start, b)
    if start < hi:
        out.append((start, hi))
    return out


def _trim(text: str, a: int, b: int) -> Range | None:
    piece = text[a:b]
    stripped = piece.strip()
    if not stripped:
        return None
    start = a + (len(piece) - len(piece.lstrip()))
    return start, start + len(stripped)


def _cut(text: str, pieces: list[Range], how: str) -> list[Range]:
    boundary = _BOUNDARIES[how]
    out = []
    for a, b in pieces:
        start = a
        for m in boundary.finditer(text, a, b):
            if (r := _trim(text, start, m.start())) is not None:
                out.append(r)
            start = m.end()
        if (r := _trim(text, start, b)) is not None:
            out.append(r)
    return out


def _n_tokens(state: KVState, r: Range) -> int:
    return int(tokens_in_ranges(state.offsets, [r]).numel())


def _windows(state: KVState, pieces: list[Range], size: int) -> list[Range]:
    out = []
    offsets = state.offsets.tolist()
    for a, b in pieces:
        inside = [(s, e) for s, e in offsets if e > s and s < b and e > a]
        for i in range(0, len(inside), size):
            chunk = inside[i : i + size]
            r = _trim(state.text, max(a, chunk[0][0]), min(b, chunk[-1][1]))
            if r is not None:
                out.append(r)
    return out


def split_passages(state: KVState, passages=None, region: Range | None = None) -> list[Range]:
    """The passages of ``state.text`` as ``(start, end)`` character ranges (a splitter's in text
    order, a list's in the order given).

    Args:
        state: a captured state.
        passages: ``None`` (the default rule, see the module), a splitter name of
            :data:`SPLITTERS`, an int (windows of that many tokens), or a list of spans (a
            substring or a regex gives one passage per occurrence; a ``(start, end)`` range one
            passage, kept as given).
        region: the character range of ``state.text`` a splitter cuts (default: all of it).

    Raises:
        InvalidInputError: an unknown splitter name, a window under 1 token, a region outside
            the text, or no passage at all (:class:`EmptySelectionError`).
    """
    text = state.text
    lo, hi = (0, len(text)) if region is None else region
    if not 0 <= lo <= hi <= len(text):
        raise InvalidInputError(f"region {region!r} is outside the text (0..{len(text)})")
    if isinstance(passages, str):
        if passages not in SPLITTERS:
            raise InvalidInputError(
                f"unknown splitter {passages!r} (known: {', '.join(SPLITTERS)}, an int of "
                "tokens, or a list of spans)"
            )
    elif passages is not None and not isinstance(passages, (int, Sequence)):
        passages = as_span_list(passages)  # a lone regex; raises InvalidTypeError otherwise
    if isinstance(passages, (list, tuple)):
        items = as_span_list(passages)
        out: list[Range] = []
        for item in items:
            out.extend(char_ranges(text, [item]))
    else:
        pieces = _segments(text, (lo, hi), template_ranges(text, state.tokenizer))
        if passages is None:
            out = []
            for para in _cut(text, pieces, "paragraphs"):
                for piece in _cut(text, [para], "lines"):
                    if _n_tokens(state, piece) > MAX_PASSAGE_TOKENS:
                        out.extend(_cut(text, [piece], "sentences"))
                    else:
                        out.append(piece)
        elif isinstance(passages, str):
            out = _cut(text, pieces, passages)
        else:
            size = checks.count("passages (tokens per window)", passages, minimum=1)
            out = _windows(state, pieces, size)
    if not out:
        raise EmptySelectionError("no passage to focus on: the text has no non-blank piece")
    return out
