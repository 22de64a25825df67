"""The example schema of the memory suite (``kvedit eval memory``): a conversation and the
questions asked about it.

A :class:`Conversation` is the messages a :class:`kvedit.Memory` is given, in order, and the
:class:`Probe` questions asked after them, each with its gold answers and its *bucket* (where
what it asks about sits in the conversation: ``"early"``, ``"middle"`` or ``"late"``, by the
thirds of :func:`bucket_of`). ``remember`` says whether each question and its answer are kept
in the memory before the next one is asked (SCBench's multi-request mode) or the memory is
left as it was.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from kvedit.errors import InvalidInputError

__all__ = ["BUCKETS", "Conversation", "Probe", "bucket_of"]

BUCKETS = ("early", "middle", "late")
"""The buckets of a question, by the third of the conversation its answer sits in."""


def bucket_of(index: int, n: int) -> str:
    """The bucket of item ``index`` of ``n`` (0-based): the third it falls in."""
    if not 0 <= index < n:
        raise InvalidInputError(f"index {index} is out of range for {n} items")
    return BUCKETS[min(3 * index // n, 2)]


@dataclass(frozen=True)
class Probe:
    """One question about a conversation.

    Attributes:
        question: the user message that asks it.
        answers: accepted answers (a prediction is correct when one is a normalized substring
            of it, :func:`kvedit.evals.metrics.best_subspan_em`).
        bucket: one of :data:`BUCKETS` (None: a question of a conversation file without
            evidence turns, :mod:`kvedit.evals.conversation_files`).
        where: the index of what it asks about (the message of a fact, the position of a gold
            document, the message of a file question's oldest evidence turn; None without
            evidence).
        category: a file question's category (None: none given, or a generated task).
        evidence: a file question's evidence turn ids.
        age_turns: the turns after a file question's oldest evidence turn (None without
            evidence, or a generated task).
    """

    question: str
    answers: tuple[str, ...]
    bucket: str | None
    where: int | None
    category: str | None = None
    evidence: tuple[str, ...] = ()
    age_turns: int | None = None


@dataclass(frozen=True)
class Conversation:
    """One example of the memory suite.

    Attributes:
        id: unique name, e.g. ``"facts-s0-e3"``.
        messages: ``(role, content)`` pairs, in order (the first may be the system message).
        probes: the questions asked after the messages, in order.
        remember: whether each question and its answer are kept before the next is asked.
    """

    id: str
    messages: tuple[tuple[str, str], ...]
    probes: tuple[Probe, ...]
    remember: bool

    def digest(self) -> str:
        """A short hash of everything the example holds (records name it, so ``--resume``
        never takes answers to another conversation under the same id)."""
        text = json.dumps(asdict(self), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
