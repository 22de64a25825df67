"""Which chat lines ``kvedit chat --focus`` emphasizes for: lines that ask (:func:`asks`).

Focus emphasizes the earlier messages a question points at; a statement ("My dog's name is
Biscuit.") points at nothing to recall, and focusing for it emphasized an unrelated old
message. A line asks when it ends with a question mark, or starts with a question word or a
request to recall or tell ("what", "who", "remind me", "tell me", "do", "is", ...).
"""

from __future__ import annotations

import re

__all__ = ["ASKING_WORDS", "asks"]

ASKING_WORDS = (
    "what",
    "whats",
    "who",
    "whom",
    "whose",
    "which",
    "when",
    "where",
    "why",
    "how",
    "do",
    "does",
    "did",
    "is",
    "are",
    "was",
    "were",
    "can",
    "could",
    "should",
    "would",
    "will",
    "have",
    "has",
    "remind",
    "tell",
    "recall",
    "list",
    "name",
    "repeat",
    "say",
)
"""First words of a line that asks (lowercase, apostrophes dropped: "what's" is "whats")."""

_WORD = re.compile(r"[a-z]+")


def asks(line: str) -> bool:
    """Whether ``line`` asks something (module docstring): it ends with ``?`` (closing quotes
    and brackets aside), or its first word is one of :data:`ASKING_WORDS`."""
    text = line.strip().rstrip("\"')]}» ")
    if text.endswith("?"):
        return True
    first = _WORD.match(text.lower().replace("'", "").replace("’", ""))
    return first is not None and first.group() in ASKING_WORDS
