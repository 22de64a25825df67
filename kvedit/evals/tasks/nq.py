"""The ``"nq"`` task: multi-document question answering on NQ-Open as in Liu et al. (2024).

The gold Wikipedia passage among distractors (:func:`nq_examples`), from the bundled data
(see ``data/ATTRIBUTION.md``) or a file in the same format (:func:`load_nq`).
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from kvedit.errors import InvalidExampleError, InvalidInputError
from kvedit.evals.jsonl import read_text
from kvedit.evals.metrics import normalize_answer
from kvedit.evals.prompts import NQ_CLOSED_BOOK_INSTRUCTION, NQ_INSTRUCTION
from kvedit.evals.schema import Example
from kvedit.evals.tasks.registry import check_positions, register_task

__all__ = [
    "NQ_CLOSED_BOOK_INSTRUCTION",
    "NQ_DATA",
    "NQ_INSTRUCTION",
    "NQItem",
    "load_nq",
    "nq_examples",
    "pick_distractors",
    "render_nq_document",
]

NQ_DATA = "evals/data/nq-open-oracle.jsonl.gz"
"""The bundled NQ-Open file, relative to the ``kvedit`` package."""


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
        source = resources.files("kvedit").joinpath(NQ_DATA)
        with source.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    else:
        lines = read_text(path).splitlines()
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
                f"{path or NQ_DATA}:{number}: bad NQ row: {error!r}"
            ) from None
    return tuple(items)


def render_nq_document(index: int, item: NQItem) -> str:
    """A passage as Liu et al. show it; ``index`` is 1-based."""
    return f"Document [{index}](Title: {item.title}) {item.text}"


def pick_distractors(
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
    containing an answer of the question (see :func:`pick_distractors`). A question's
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
    positions = check_positions(positions, n_docs)
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
    distractors = {q: pick_distractors(items, q, n_docs - 1, rng, padded) for q in questions}
    examples = []
    for position in positions:
        for q in questions:
            order = [*distractors[q][:position], q, *distractors[q][position:]]
            examples.append(
                Example(
                    id=f"nq-s{seed}-q{q}-p{position}",
                    instruction=NQ_INSTRUCTION,
                    documents=tuple(
                        render_nq_document(i, items[j]) for i, j in enumerate(order, start=1)
                    ),
                    separator="\n",
                    question=items[q].question,
                    answers=items[q].answers,
                    gold_index=position,
                    metric="subspan_em",
                )
            )
    return examples
