"""A text's words, and which of them tell one passage from another.

The one definition :mod:`kvedit.focusing.scoring` (a question's distinctive words: the passages
it points at) and :mod:`kvedit.focusing.guard` (an answer's telling words: the passages it came
from) share. A word is a run of letters and digits, lower-cased; a word held by more than
:data:`COMMON_SHARE` of the passages (and by more than one) is common: it tells none of them
apart from the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["COMMON_SHARE", "common_words", "holders", "most", "split_words", "words"]

COMMON_SHARE = 0.5
"""A word held by more than this share of the passages is shared context (a template's
"assignment", the topic's "winner", the question's form), not a sign of one passage; half is
the middle of a range of shares that decide alike (tuning: reports/focus/README.md)."""

_WORD = re.compile(r"[^\W_]+")
_WORD_OR_NOT = re.compile(r"[^\W_]+|[\W_]+")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text``, in order: runs of letters and digits (any other
    character, an underscore too, splits them). ``"Cy Diaz's code_2"`` gives
    ``["cy", "diaz", "s", "code", "2"]``."""
    return _WORD.findall(text.lower())


def split_words(text: str) -> list[str]:
    """``text`` cut into alternating pieces, each a word (as :func:`words` reads it, not
    lower-cased) or the characters between two words; ``"".join`` gives ``text`` back."""
    return _WORD_OR_NOT.findall(text)


def holders(wanted: Iterable[str], texts: Sequence[str]) -> dict[str, set[int]]:
    """Each word of ``wanted`` (lower-cased, as :func:`words` gives them) and the indices of
    the ``texts`` that hold it as a word."""
    held = [set(words(t)) for t in texts]
    return {w: {i for i, s in enumerate(held) if w in s} for w in set(wanted)}


def most(n: int, share: float = COMMON_SHARE) -> float:
    """The most of ``n`` passages a word may be held by and still tell them apart: ``share``
    of them, and at least one."""
    return max(1.0, share * n)


def common_words(texts: Sequence[str], share: float = COMMON_SHARE) -> set[str]:
    """The words held by more than :func:`most` of ``texts`` (``share`` of them, and more
    than one); none when ``texts`` is empty. ``share`` 1 makes none common."""
    counts: dict[str, int] = {}
    for text in texts:
        for w in set(words(text)):
            counts[w] = counts.get(w, 0) + 1
    limit = most(len(texts), share)
    return {w for w, c in counts.items() if c > limit}
