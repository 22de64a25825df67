"""Spans: which tokens of a text an edit touches.

A span is a substring (every occurrence counts), a compiled regular expression (every match), or
a ``(start, end)`` character range. A token belongs to a span when its character range overlaps
the span at all. Zero-width tokens (BOS, other special tokens) never overlap anything.
"""

from __future__ import annotations

import bisect
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from .checks import describe
from .errors import InvalidInputError, InvalidTypeError, SpanNotFoundError

Span = str | re.Pattern | tuple[int, int]
Spans = Span | Sequence[Span]

_PREVIEW = 300


def _preview(text: str) -> str:
    if len(text) <= _PREVIEW:
        return repr(text)
    half = _PREVIEW // 2
    return repr(text[:half]) + f" ... ({len(text)} chars) ... " + repr(text[-half:])


def _as_range(span: tuple) -> tuple[int, int] | None:
    """A ``(start, end)`` tuple of two ints (Python, numpy or 0-d torch) as ints, else None."""
    if len(span) != 2:
        return None
    out = []
    for x in span:
        if isinstance(x, bool):
            return None
        if isinstance(x, torch.Tensor) and x.ndim == 0 and not x.is_floating_point():
            x = x.item()
        if not isinstance(x, numbers.Integral) or isinstance(x, bool):
            return None
        out.append(int(x))
    return out[0], out[1]


def as_span_list(spans: Spans) -> list[Span]:
    """Normalise one span or a sequence of spans into a list, validating each.

    Raises:
        InvalidTypeError: ``spans`` (or an item of it) is not a span: None, an int, a dict,
            bytes... (a ``TypeError`` and a ``ValueError``).
        InvalidInputError: an empty string or pattern, or a range that is not
            ``0 <= start < end``.
    """
    if isinstance(spans, (str, re.Pattern)):
        items: list = [spans]
    elif isinstance(spans, tuple) and _as_range(spans) is not None:
        items = [spans]
    elif isinstance(spans, Iterable) and not isinstance(spans, (bytes, bytearray, Mapping)):
        items = list(spans)
    else:
        raise InvalidTypeError(
            "spans must be a str, a compiled regex, a (start, end) tuple, or a list of them, "
            f"not {describe(spans)}"
        )
    out: list[Span] = []
    for span in items:
        if isinstance(span, str):
            if not span:
                raise InvalidInputError("empty span: a span must be a non-empty string")
            out.append(span)
        elif isinstance(span, re.Pattern):
            if not span.pattern:
                raise InvalidInputError("empty span: the regular expression is empty")
            out.append(span)
        elif isinstance(span, tuple) and len(span) == 2:
            bounds = _as_range(span)
            if bounds is None:
                raise InvalidTypeError(f"bad character range {span!r}: start and end must be ints")
            start, end = bounds
            if start >= end or start < 0:
                raise InvalidInputError(f"bad character range {span!r}: need 0 <= start < end")
            out.append(bounds)
        else:
            raise InvalidTypeError(
                f"a span is a str, a compiled regex or a (start, end) tuple, not {describe(span)}"
            )
    return out


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


def word_index(text: str, offsets: torch.Tensor) -> torch.Tensor:
    """``LongTensor[n]``: for each token, the number of the whitespace-separated word of
    ``text`` its first non-space character falls in (``offsets`` ``[n, 2]``: the tokens'
    character ranges); a token without one (whitespace, a special token's empty range) gets a
    number no other token has. Tokens of one word share its number: ``"SZ-611."`` is one word,
    however many tokens it takes."""
    starts = [m.start() for m in re.finditer(r"\S+", text)]
    out = []
    for i, (a, b) in enumerate(offsets.tolist()):
        part = text[a:b]
        first = a + len(part) - len(part.lstrip())
        out.append(bisect.bisect_right(starts, first) - 1 if first < b else len(starts) + i)
    return torch.tensor(out, dtype=torch.long)


def token_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, torch.Tensor]:
    """Decode ``ids`` and give each token's character range in the decoded text.

    Returns ``(text, offsets [n, 2])``. Special tokens are kept in the text and get zero-width
    ranges at their place, so spans never select them.

    The text is ``tokenizer.decode(ids)`` (special tokens kept, no clean-up of spaces). A fast
    tokenizer then encodes that text again with ``return_offsets_mapping``: when the ids come
    back the same, which they do for any text the tokenizer itself encoded, its own offsets are
    the answer (in linear time, and exact for every kind of tokenizer: byte-level BPE,
    SentencePiece-style ``▁`` tokens whose decoder drops a leading space, multi-byte
    characters). Only ids that do not round-trip (spliced or generated sequences) are decoded
    incrementally instead, one token at a time with its left context (the tokenizers library's
    ``DecodeStream``, else a short window of ``decode`` calls): each token gets the text it
    adds, and tokens that only complete a character share that character's range.
    """
    ids = [int(i) for i in ids]
    if not ids:
        return "", torch.zeros(0, 2, dtype=torch.long)
    text = _decode(tokenizer, ids)
    offsets = _offsets_from_encoding(tokenizer, text, ids)
    if offsets is None:
        pieces = _pieces_from_stream(tokenizer, ids)
        if pieces is None:
            pieces = _pieces_from_windows(tokenizer, ids)
        text, offsets = _offsets_from_pieces(pieces)
    return text, zero_width_specials(tokenizer, ids, offsets)


def zero_width_specials(tokenizer, ids: Sequence[int], offsets: torch.Tensor) -> torch.Tensor:
    """``offsets`` ``[n, 2]`` with every special token's range made empty at its start (so
    spans never select a special token); changed in place and returned."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    for i, tid in enumerate(ids):
        if tid in special:
            offsets[i, 1] = offsets[i, 0]
    return offsets


def _decode(tokenizer, ids: Sequence[int]) -> str:
    if not ids:
        return ""
    return tokenizer.decode(
        list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _offsets_from_encoding(tokenizer, text: str, ids: list[int]) -> torch.Tensor | None:
    """The fast tokenizer's own offsets of ``text``, if encoding it gives back ``ids``."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        enc = tokenizer(
            text,
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
    except (NotImplementedError, ValueError, TypeError):
        return None
    if list(enc["input_ids"]) != ids:
        return None
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    if offsets.shape[0] != len(ids) or (len(ids) and int(offsets.max()) > len(text)):
        return None
    return offsets


def _pieces_from_stream(tokenizer, ids: list[int]) -> list[str | None] | None:
    """Per token, the text it adds (None: it only starts a character), from ``DecodeStream``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - tokenizers < 0.21
        return None
    if not isinstance(backend, Tokenizer):
        return None
    stream = DecodeStream(skip_special_tokens=False)
    try:
        return [stream.step(backend, tid) for tid in ids]
    except Exception:  # noqa: BLE001 - any failure of the stream: use the window decoder
        return None


def _pieces_from_windows(tokenizer, ids: list[int]) -> list[str | None]:
    """Per token, the text it adds, by decoding short windows (any tokenizer with ``decode``).

    The window starts one emitted token back, so decoders that drop a leading space (only at
    the start of what they decode) drop it from the prefix and the window alike.
    """
    pieces: list[str | None] = []
    prefix_offset = read_offset = 0
    prefix = ""
    for i in range(len(ids)):
        new = _decode(tokenizer, ids[prefix_offset : i + 1])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            pieces.append(new[len(prefix) :])
            prefix_offset, read_offset = read_offset, i + 1
            prefix = _decode(tokenizer, ids[prefix_offset:read_offset])
        else:
            pieces.append(None)
    if pieces and pieces[-1] is None:  # a character left incomplete at the end
        rest = _decode(tokenizer, ids[prefix_offset:])[len(prefix) :]
        pieces[-1] = rest or None
    return pieces


def _offsets_from_pieces(pieces: list[str | None]) -> tuple[str, torch.Tensor]:
    """Text and offsets from each token's added text; tokens that added nothing yet share the
    range of the piece that completes them."""
    offsets = torch.zeros(len(pieces), 2, dtype=torch.long)
    parts: list[str] = []
    pos = 0
    pending: list[int] = []
    for i, piece in enumerate(pieces):
        pending.append(i)
        if piece is None:
            continue
        start, pos = pos, pos + len(piece)
        parts.append(piece)
        for j in pending:
            offsets[j, 0], offsets[j, 1] = start, pos
        pending = []
    for j in pending:
        offsets[j, 0] = offsets[j, 1] = pos
    return "".join(parts), offsets
