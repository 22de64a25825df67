"""Examples for the lost-in-the-middle evaluation suite, and the tasks that generate them.

An :class:`Example` is one prompt: an instruction, some documents (one of which, the gold
document, holds the answer), and a question. Its :meth:`~Example.user_message` puts the
documents before the question, so a KV cache can be captured over the instruction and the
documents (up to :meth:`~Example.documents_end`) and then edited before the question is read.

Tasks, registered by name in :data:`TASKS`:

``"records"`` (:func:`records_examples`)
    Synthetic key-value retrieval: ``n`` records "<name>'s secret number is <number>." and a
    question about the record at the gold position.
``"nq"`` (:func:`nq_examples`)
    Multi-document question answering on NQ-Open as in Liu et al. (2024): the gold Wikipedia
    passage among distractors (the bundled data, see ``data/ATTRIBUTION.md``).

Custom examples are read from, and written to, JSON lines with :func:`load_jsonl` and
:func:`write_jsonl`.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidExampleError, InvalidInputError
from kvedit.evals.metrics import METRICS, extract_numbers, normalize_answer

__all__ = [
    "NQ_CLOSED_BOOK_INSTRUCTION",
    "NAMES",
    "NQ_INSTRUCTION",
    "RECORDS_INSTRUCTION",
    "TASKS",
    "Example",
    "InvalidExampleError",
    "NQItem",
    "atomic_write",
    "load_jsonl",
    "load_nq",
    "nq_examples",
    "records_examples",
    "register_task",
    "write_jsonl",
]

RECORDS_INSTRUCTION = (
    "Below are some records. Answer the question using the records. Answer with the number only."
)
NQ_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results"
    " (some of which might be irrelevant)."
)
NQ_CLOSED_BOOK_INSTRUCTION = "Write a high-quality answer for the given question."

# The instruction :meth:`Example.closed_book` switches to by default: an instruction that
# refers to documents is replaced by one that does not.
_CLOSED_BOOK_INSTRUCTIONS = {NQ_INSTRUCTION: NQ_CLOSED_BOOK_INSTRUCTION}

# "Document [k]" at the start of a document rendered the Liu et al. way.
_DOCUMENT_LABEL = re.compile(r"^Document \[\d+\]")

_NQ_DATA = "evals/data/nq-open-oracle.jsonl.gz"

# 80 distinct first names from many languages; none is a prefix of another.
NAMES: tuple[str, ...] = (
    "Alice", "Bruno", "Carmen", "Dmitri", "Elena", "Farid", "Grace", "Hiroshi",
    "Ingrid", "Jamal", "Keiko", "Lorenzo", "Maya", "Nikhil", "Olga", "Pablo",
    "Quentin", "Rosa", "Samir", "Tessa", "Umar", "Valeria", "Wei", "Ximena",
    "Yusuf", "Zara", "Amir", "Beatriz", "Chen", "Dalia", "Emeka", "Fiona",
    "Gustavo", "Hana", "Ivan", "Julia", "Kwame", "Leila", "Mateo", "Nadia",
    "Oscar", "Priya", "Rafael", "Sofia", "Tomas", "Ursula", "Victor", "Wanda",
    "Yara", "Zoltan", "Abigail", "Boris", "Chloe", "Diego", "Esther", "Felix",
    "Greta", "Hugo", "Irene", "Jonas", "Kofi", "Lucia", "Marcus", "Nora",
    "Omar", "Paula", "Ruben", "Sakura", "Theo", "Ulrich", "Vera", "Walter",
    "Xavier", "Yvonne", "Zeynep", "Anika", "Bashir", "Clara", "Dorian", "Elif",
)  # fmt: skip


_FIELDS = ("id", "instruction", "documents", "separator", "question", "answers", "gold_index")
_OPTIONAL_FIELDS = ("metric",)


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
        parts.append("Question: " + self.question)
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
                :data:`NQ_CLOSED_BOOK_INSTRUCTION`.
        """
        if instruction is None:
            instruction = _CLOSED_BOOK_INSTRUCTIONS.get(self.instruction, self.instruction)
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

    # -- serialization ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The example as a JSON-ready dict (the format of :func:`load_jsonl`)."""
        data = dataclasses.asdict(self)
        data["documents"] = list(self.documents)
        data["answers"] = list(self.answers)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Example:
        """Build an example from a dict in the format of :func:`load_jsonl`, strictly.

        Raises:
            InvalidExampleError: a key is missing or unknown, or a value is invalid.
        """
        if not isinstance(data, Mapping):
            raise InvalidExampleError(f"expected a JSON object, got {type(data).__name__}")
        missing = [key for key in _FIELDS if key not in data]
        if missing:
            raise InvalidExampleError(f"missing key(s): {', '.join(missing)}")
        unknown = sorted(set(data) - set(_FIELDS) - set(_OPTIONAL_FIELDS))
        if unknown:
            raise InvalidExampleError(f"unknown key(s): {', '.join(unknown)}")
        for key in ("documents", "answers"):
            if not isinstance(data[key], list):
                raise InvalidExampleError(f"{key} must be a list of strings, got {data[key]!r}")
        return cls(**data)


# -- files ------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``, gunzipped when its name ends in ``.gz``."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def load_jsonl(path: str | os.PathLike[str]) -> list[Example]:
    """Read examples from a JSON-lines file (gzipped when the name ends in ``.gz``).

    One example per line::

        {"id": str, "instruction": str, "documents": [str, ...], "separator": str,
         "question": str, "answers": [str, ...], "gold_index": int,
         "metric": "subspan_em" | "first_number"}

    ``metric`` may be left out (``"subspan_em"``); any other key is an error. ``gold_index``
    must index ``documents`` (or be ``-1`` when ``documents`` is empty). Blank lines are
    skipped. Ids must be unique.

    Raises:
        InvalidExampleError: (a ``ValueError``) naming the file, the line number and the
            problem: bad JSON, a missing or unknown key, a value of the wrong type, an
            out-of-range ``gold_index``, an unknown metric, a duplicate id, or no examples.
    """
    path = Path(path)
    examples: list[Example] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidExampleError(f"{path}:{number}: bad JSON: {error}") from None
        try:
            example = Example.from_dict(data)
        except InvalidExampleError as error:
            raise InvalidExampleError(f"{path}:{number}: {error}") from None
        if example.id in seen:
            raise InvalidExampleError(
                f"{path}:{number}: duplicate id {example.id!r} (first on line {seen[example.id]})"
            )
        seen[example.id] = number
        examples.append(example)
    if not examples:
        raise InvalidExampleError(f"{path}: no examples")
    return examples


def write_jsonl(examples: Iterable[Example], path: str | os.PathLike[str]) -> Path:
    """Write ``examples`` to ``path`` in the format of :func:`load_jsonl`, atomically.

    The file is gzipped when its name ends in ``.gz``. Returns the path.
    """
    path = Path(path)
    text = "".join(json.dumps(example.to_dict(), ensure_ascii=False) + "\n" for example in examples)
    payload = gzip.compress(text.encode("utf-8"), mtime=0) if path.suffix == ".gz" else text
    return atomic_write(path, payload)


# -- registry ---------------------------------------------------------------------------------

TaskFn = TypeVar("TaskFn", bound=Callable[..., list[Example]])

TASKS: dict[str, Callable[..., list[Example]]] = {}
"""Task name -> function returning that task's examples (keyword arguments vary by task)."""


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """Decorator registering a function that returns examples under ``name`` in :data:`TASKS`.

    Registering a function again under its own name (as a module reload does) is allowed.

    Raises:
        ValueError: ``name`` is already registered to another function.
    """

    def decorator(fn: TaskFn) -> TaskFn:
        old = TASKS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (
            fn.__module__,
            fn.__qualname__,
        ):
            raise InvalidInputError(f"task {name!r} is already registered")
        TASKS[name] = fn
        return fn

    return decorator


def _check_positions(positions: Sequence[int], n_documents: int) -> tuple[int, ...]:
    positions = tuple(positions)
    if not positions:
        raise InvalidInputError("positions must not be empty")
    bad = [p for p in positions if not 0 <= p < n_documents]
    if bad:
        raise InvalidInputError(f"positions {bad} are out of range for {n_documents} documents")
    if len(set(positions)) != len(positions):
        raise InvalidInputError(f"positions must be distinct, got {list(positions)}")
    return positions


# -- records ----------------------------------------------------------------------------------


@register_task("records")
def records_examples(
    n_records: int = 20,
    positions: Sequence[int] = (0, 5, 10, 15, 19),
    trials: int = 30,
    seed: int = 0,
) -> list[Example]:
    """Synthetic retrieval: find one person's secret number among ``n_records`` records.

    Trial ``t`` draws ``n_records`` distinct names (from :data:`NAMES`), distinct four-digit
    numbers (1000 to 9999) and the person asked about. Every position uses the same records
    in the same order, except that the asked-about record moves to the gold position, so
    positions are compared on equal footing. Records are ``"<name>'s secret number is
    <number>."`` separated by newlines; the question is ``"What is <name>'s secret
    number?"``; the metric is ``"first_number"``.

    Returns ``len(positions) * trials`` examples, grouped by position then trial, with ids
    ``records-s{seed}-t{trial}-p{position}``. Deterministic in its arguments.

    Raises:
        ValueError: ``n_records`` is not in ``[1, len(NAMES)]``, ``trials < 0``, or a
            position is out of range or repeated.
    """
    if not 1 <= n_records <= len(NAMES):
        raise InvalidInputError(f"n_records must be in [1, {len(NAMES)}], got {n_records}")
    if trials < 0:
        raise InvalidInputError(f"trials must be >= 0, got {trials}")
    positions = _check_positions(positions, n_records)
    rng = random.Random(seed)
    drawn = []  # per trial: (the other records, in order; the asked-about name and number)
    for _ in range(trials):
        names = rng.sample(NAMES, n_records)
        numbers = rng.sample(range(1000, 10000), n_records)
        target = rng.randrange(n_records)
        records = [f"{name}'s secret number is {number}." for name, number in zip(names, numbers)]
        gold = records.pop(target)
        drawn.append((records, gold, names[target], str(numbers[target])))
    examples = []
    for position in positions:
        for trial, (others, gold, name, number) in enumerate(drawn):
            examples.append(
                Example(
                    id=f"records-s{seed}-t{trial}-p{position}",
                    instruction=RECORDS_INSTRUCTION,
                    documents=(*others[:position], gold, *others[position:]),
                    separator="\n",
                    question=f"What is {name}'s secret number?",
                    answers=(number,),
                    gold_index=position,
                    metric="first_number",
                )
            )
    return examples


# -- NQ ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NQItem:
    """One NQ-Open question with its gold Wikipedia passage."""

    question: str
    answers: tuple[str, ...]
    title: str
    text: str


@functools.cache
def load_nq(path: str | None = None) -> tuple[NQItem, ...]:
    """The NQ-Open questions of ``path`` (default: the bundled ``nq-open-oracle.jsonl.gz``).

    Each line is ``{"question", "answers", "ctxs": [{"title", "text", ...}, ...], ...}``; the
    passage is the one of ``ctxs`` marked ``"isgold"`` (else the first). Cached per path.
    """
    if path is None:
        source = resources.files("kvedit").joinpath(_NQ_DATA)
        with source.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    else:
        lines = _read_text(Path(path)).splitlines()
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            passage = next((c for c in row["ctxs"] if c.get("isgold")), row["ctxs"][0])
            items.append(
                NQItem(row["question"], tuple(row["answers"]), passage["title"], passage["text"])
            )
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
            raise InvalidExampleError(
                f"{path or _NQ_DATA}:{number}: bad NQ row: {error!r}"
            ) from None
    return tuple(items)


def _render_nq_document(index: int, item: NQItem) -> str:
    """A passage as Liu et al. show it; ``index`` is 1-based."""
    return f"Document [{index}](Title: {item.title}) {item.text}"


def _pick_distractors(
    items: Sequence[NQItem], gold: int, k: int, rng: random.Random, padded: dict[int, str]
) -> list[int]:
    """``k`` indices of passages to show with question ``gold``, drawn with ``rng``.

    A candidate is skipped when it is the gold passage (or a copy of it), already chosen, or
    contains a gold answer as whole words after normalization, so that the answer is only in
    the gold document. ``padded`` caches the normalized passages.
    """
    answers = [f" {a} " for a in map(normalize_answer, items[gold].answers) if a]
    seen = {(items[gold].title, items[gold].text)}
    chosen: list[int] = []
    attempts = 100 * k + 1000
    while len(chosen) < k and attempts > 0:
        attempts -= 1
        candidate = rng.randrange(len(items))
        item = items[candidate]
        if (item.title, item.text) in seen:
            continue
        if candidate not in padded:
            padded[candidate] = f" {normalize_answer(item.title + ' ' + item.text)} "
        if any(answer in padded[candidate] for answer in answers):
            continue
        seen.add((item.title, item.text))
        chosen.append(candidate)
    if len(chosen) == k:
        return chosen
    raise InvalidInputError(f"could not find {k} distractors for NQ question {gold}")


@register_task("nq")
def nq_examples(
    n_docs: int = 10,
    positions: Sequence[int] = (0, 4, 9),
    trials: int | None = None,
    seed: int = 0,
    limit: int | None = None,
    path: str | os.PathLike[str] | None = None,
) -> list[Example]:
    """Multi-document QA on NQ-Open (Liu et al., 2024): the gold passage among distractors.

    Args:
        n_docs: Documents per prompt: the gold passage and ``n_docs - 1`` distractors.
        positions: 0-based positions of the gold passage to evaluate.
        trials: Questions per position, a seeded sample of the question pool (``None``: all).
        seed: Seed of the question sample and of the distractors.
        limit: The question pool is the first ``limit`` questions of the file (``None``: all).
            Distractors are drawn from the whole file either way.
        path: An NQ file in the same format (default: the bundled data).

    Each distractor is the gold passage of another question, drawn by seed, distinct, and not
    containing an answer of the question (see :func:`_pick_distractors`). A question's
    distractors keep their order at every position; only the gold passage moves, so every
    position asks the same questions on the same documents. Documents are rendered
    ``"Document [i](Title: {title}) {text}"`` (``i`` 1-based in the shown order) and
    separated by newlines, after the instruction :data:`NQ_INSTRUCTION`; the metric is
    ``"subspan_em"``.

    Returns ``len(positions) * n_questions`` examples, grouped by position then question
    (in file order), with ids ``nq-s{seed}-q{row}-p{position}`` (``row``: 0-based line of
    the question in the file). Deterministic in its arguments.

    Raises:
        ValueError: ``n_docs`` is not in ``[1, number of questions]``, ``trials`` or
            ``limit`` is negative, ``trials`` exceeds the pool, or a position is out of range
            or repeated.
    """
    items = load_nq(None if path is None else os.fspath(path))
    if not 1 <= n_docs <= len(items):
        raise InvalidInputError(f"n_docs must be in [1, {len(items)}], got {n_docs}")
    positions = _check_positions(positions, n_docs)
    if limit is not None and limit < 0:
        raise InvalidInputError(f"limit must be >= 0, got {limit}")
    pool = range(len(items) if limit is None else min(limit, len(items)))
    if trials is not None and not 0 <= trials <= len(pool):
        raise InvalidInputError(
            f"trials must be in [0, {len(pool)}] (the question pool), got {trials}"
        )
    rng = random.Random(seed)
    questions = list(pool) if trials is None else sorted(rng.sample(pool, trials))
    padded: dict[int, str] = {}
    distractors = {q: _pick_distractors(items, q, n_docs - 1, rng, padded) for q in questions}
    examples = []
    for position in positions:
        for q in questions:
            order = [*distractors[q][:position], q, *distractors[q][position:]]
            examples.append(
                Example(
                    id=f"nq-s{seed}-q{q}-p{position}",
                    instruction=NQ_INSTRUCTION,
                    documents=tuple(
                        _render_nq_document(i, items[j]) for i, j in enumerate(order, start=1)
                    ),
                    separator="\n",
                    question=items[q].question,
                    answers=items[q].answers,
                    gold_index=position,
                    metric="subspan_em",
                )
            )
    return examples
