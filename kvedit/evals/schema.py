"""The example schema of the lost-in-the-middle evaluation suite.

An :class:`Example` is one prompt: an instruction, some documents (one of which, the gold
document, holds the answer), and a question. Its :meth:`~Example.user_message` puts the
documents before the question, so a KV cache can be captured over the instruction and the
documents (up to :meth:`~Example.documents_end`) and then edited before the question is read.
:func:`score` scores a prediction with the example's metric.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvedit.errors import InvalidExampleError
from kvedit.evals.metrics import METRICS, extract_numbers
from kvedit.evals.prompts import CLOSED_BOOK_INSTRUCTIONS
from kvedit.prompts import QUESTION_LABEL

__all__ = ["FIELDS", "OPTIONAL_FIELDS", "Example", "score"]

# "Document [k]" at the start of a document rendered the Liu et al. way.
_DOCUMENT_LABEL = re.compile(r"^Document \[\d+\]")

FIELDS = ("id", "instruction", "documents", "separator", "question", "answers", "gold_index")
"""The keys every serialized example has (:meth:`Example.from_json`)."""
OPTIONAL_FIELDS = ("metric",)
"""The keys a serialized example may leave out."""


@dataclass(frozen=True)
class Example:
    """One evaluation prompt: instruction, documents (one of them gold), question, answers.

    Attributes:
        id: Unique name of the example, e.g. ``"records-s0-t3-p10"``.
        instruction: Text before the documents; may be empty.
        documents: The documents, in the order shown.
        separator: What is put between two documents.
        question: The question, asked after the documents.
        answers: The accepted answers (at least one).
        gold_index: Index in ``documents`` of the document that holds the answer; ``-1``
            exactly when there are no documents (a closed-book example).
        metric: Name of the metric in :data:`kvedit.evals.metrics.METRICS` that scores it.

    Lists given for ``documents`` and ``answers`` are stored as tuples. Invalid values raise
    :class:`InvalidExampleError`.
    """

    id: str
    instruction: str
    documents: tuple[str, ...]
    separator: str
    question: str
    answers: tuple[str, ...]
    gold_index: int
    metric: str = "subspan_em"

    def __post_init__(self) -> None:
        for name in ("documents", "answers"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise InvalidExampleError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for name in ("id", "instruction", "separator", "question"):
            if not isinstance(getattr(self, name), str):
                raise InvalidExampleError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not self.id:
            raise InvalidExampleError("id must not be empty")
        if not self.question:
            raise InvalidExampleError(f"example {self.id!r}: question must not be empty")
        if not all(isinstance(document, str) for document in self.documents):
            raise InvalidExampleError(f"example {self.id!r}: every document must be a string")
        if not self.answers or not all(isinstance(answer, str) for answer in self.answers):
            raise InvalidExampleError(
                f"example {self.id!r}: answers must be a non-empty list of strings"
            )
        if not isinstance(self.gold_index, int) or isinstance(self.gold_index, bool):
            raise InvalidExampleError(
                f"example {self.id!r}: gold_index must be an integer, got {self.gold_index!r}"
            )
        if self.documents and not 0 <= self.gold_index < len(self.documents):
            raise InvalidExampleError(
                f"example {self.id!r}: gold_index {self.gold_index} is out of range for "
                f"{len(self.documents)} documents"
            )
        if not self.documents and self.gold_index != -1:
            raise InvalidExampleError(
                f"example {self.id!r}: an example without documents must have gold_index -1, "
                f"got {self.gold_index}"
            )
        if self.metric not in METRICS:
            raise InvalidExampleError(
                f"example {self.id!r}: unknown metric {self.metric!r} "
                f"(known: {', '.join(sorted(METRICS))})"
            )
        if self.metric == "first_number" and not all(map(extract_numbers, self.answers)):
            raise InvalidExampleError(
                f"example {self.id!r}: metric 'first_number' needs every answer to contain a "
                f"number, got {list(self.answers)!r}"
            )

    # -- the prompt ---------------------------------------------------------------------------

    def _documents_start(self) -> int:
        return len(self.instruction) + 2 if self.instruction else 0

    def user_message(self) -> str:
        """The prompt: instruction, documents, then the question.

        Exactly ``instruction + "\\n\\n" + separator.join(documents) + "\\n\\nQuestion: " +
        question``, except that an empty instruction, and an empty tuple of documents, are
        left out together with the blank line that would follow them: the parts that are
        present are joined by ``"\\n\\n"``.
        """
        parts = [self.instruction] if self.instruction else []
        if self.documents:
            parts.append(self.separator.join(self.documents))
        parts.append(QUESTION_LABEL + self.question)
        return "\n\n".join(parts)

    def documents_end(self) -> int:
        """Character offset in :meth:`user_message` where the documents end.

        ``user_message()[:documents_end()]`` is the context over which a cache is captured;
        the rest, starting with ``"\\n\\nQuestion: "`` (or ``"Question: "`` when there is
        neither instruction nor documents), asks the question. Without documents this is the
        end of the instruction.
        """
        if not self.documents:
            return len(self.instruction)
        return self._documents_start() + len(self.separator.join(self.documents))

    def document_spans(self) -> list[tuple[int, int]]:
        """The ``(start, end)`` character range of every document in :meth:`user_message`.

        ``user_message()[start:end] == documents[i]`` for the ``i``-th span.
        """
        spans = []
        start = self._documents_start()
        for document in self.documents:
            spans.append((start, start + len(document)))
            start += len(document) + len(self.separator)
        return spans

    @property
    def gold_document(self) -> str | None:
        """The document that holds the answer, or ``None`` for a closed-book example."""
        return self.documents[self.gold_index] if self.documents else None

    # -- variants -----------------------------------------------------------------------------

    def with_documents(
        self, documents: Sequence[str], gold_index: int, *, id: str | None = None
    ) -> Example:
        """A copy with other documents (and gold index), and optionally another id."""
        return dataclasses.replace(
            self, documents=tuple(documents), gold_index=gold_index, id=id or self.id
        )

    def closed_book(self, instruction: str | None = None) -> Example:
        """The example without documents (gold index ``-1``), id suffixed ``"-closed"``.

        Args:
            instruction: Instruction of the closed-book prompt. ``None`` keeps the current
                one, except that the NQ instruction, which refers to search results, becomes
                :data:`~kvedit.evals.prompts.NQ_CLOSED_BOOK_INSTRUCTION`.
        """
        if instruction is None:
            instruction = CLOSED_BOOK_INSTRUCTIONS.get(self.instruction, self.instruction)
        return dataclasses.replace(
            self, id=f"{self.id}-closed", instruction=instruction, documents=(), gold_index=-1
        )

    def gold_only(self) -> Example:
        """The example with only its gold document (gold index 0), id suffixed ``"-gold"``.

        A document rendered the Liu et al. way (``"Document [k](Title: ...) ..."``) is
        renumbered ``"Document [1]"``, as in their oracle setting.

        Raises:
            InvalidExampleError: the example has no documents.
        """
        if not self.documents:
            raise InvalidExampleError(f"example {self.id!r} has no gold document")
        gold = _DOCUMENT_LABEL.sub("Document [1]", self.documents[self.gold_index], count=1)
        return self.with_documents((gold,), 0, id=f"{self.id}-gold")

    def digest(self) -> str:
        """A short hash of what the example asks: everything but its id (16 hex digits).

        Results are matched to examples by id *and* digest (``--reuse``, ``--resume``): an id
        such as ``nq-s0-q8-p0`` names the question and the gold position, not the documents,
        which depend on ``--n-docs``, ``--trials``, ``--limit`` and ``--data``.
        """
        data = self.to_json()
        del data["id"]
        text = json.dumps(data, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- serialization ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The example as a JSON-ready dict (a line of :func:`~kvedit.evals.jsonl.load_jsonl`)."""
        data = dataclasses.asdict(self)
        data["documents"] = list(self.documents)
        data["answers"] = list(self.answers)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Example:
        """Build an example from a dict, a line of :func:`~kvedit.evals.jsonl.load_jsonl`, strictly.

        Raises:
            InvalidExampleError: a key is missing or unknown, or a value is invalid.
        """
        if not isinstance(data, Mapping):
            raise InvalidExampleError(f"expected a JSON object, got {type(data).__name__}")
        missing = [key for key in FIELDS if key not in data]
        if missing:
            raise InvalidExampleError(f"missing key(s): {', '.join(missing)}")
        unknown = sorted(set(data) - set(FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise InvalidExampleError(f"unknown key(s): {', '.join(unknown)}")
        for key in ("documents", "answers"):
            if not isinstance(data[key], list):
                raise InvalidExampleError(f"{key} must be a list of strings, got {data[key]!r}")
        return cls(**data)


def score(example: Example, prediction: str) -> float:
    """Score ``prediction`` against ``example.answers`` with the example's metric."""
    return METRICS[example.metric](prediction, example.answers)
