"""The ``nq-shared`` task of the memory suite: SCBench's multi-request mode on the bundled
NQ-Open data.

One conversation (:func:`nq_shared_examples`) holds the gold passages of ``n_questions``
questions among distractors, ``n_docs`` documents in all, one ``tool`` message each (rendered
as Liu et al. show them, :func:`~kvedit.evals.tasks.nq.render_nq_document`), after a user
message that says what follows. The questions are then asked one after another against the one
memory, each question and its answer *kept* (``remember=True``): a shared context serving a
series of requests, as SCBench's multi-request mode. The documents are separate messages, not
one user message, so that a memory with a budget can forget some of them: one message is never
forgotten while it is added, and one message of all the documents would not fit a budget below
1.

The gold passages sit at seeded positions, ``n_questions / 3`` in each third of the documents
(the bucket of a question is the third of its gold passage). Distractors are other questions'
gold passages containing no answer of the conversation's questions, and no gold passage
contains another question's answer, so each answer is in its own gold passage only.
"""

from __future__ import annotations

import random

from kvedit.errors import InvalidInputError
from kvedit.evals.metrics import normalize_answer
from kvedit.evals.tasks.memory_schema import BUCKETS, Conversation, Probe, bucket_of
from kvedit.evals.tasks.nq import load_nq, render_nq_document
from kvedit.evals.tasks.registry import register_memory_task

__all__ = ["NQ_SHARED_ASK", "NQ_SHARED_INTRO", "nq_shared_examples"]

NQ_SHARED_INTRO = (
    "Here are some search results, one per message. I will ask you several questions; "
    "answer each with a few words, using only these results."
)
NQ_SHARED_ASK = "Question: {q}\nAnswer in a few words."


def _padded(item) -> str:
    return f" {normalize_answer(item.title + ' ' + item.text)} "


def _answers(item) -> list[str]:
    return [f" {a} " for a in map(normalize_answer, item.answers) if a]


def _conversation(index: int, seed: int, n_docs: int, n_questions: int) -> Conversation:
    items = load_nq()
    rng = random.Random(f"nq-shared-{seed}-{index}")
    for _ in range(100):
        golds = rng.sample(range(len(items)), n_questions)
        answers = {q: _answers(items[q]) for q in golds}
        clash = any(
            a in _padded(items[g]) for q in golds for g in golds if g != q for a in answers[q]
        )
        if not clash and all(answers.values()):
            break
    else:  # pragma: no cover - the bundled file has thousands of questions
        raise InvalidInputError(f"could not draw {n_questions} NQ questions apart")
    every = [a for q in golds for a in answers[q]]
    seen = {(items[q].title, items[q].text) for q in golds}
    distractors: list[int] = []
    while len(distractors) < n_docs - n_questions:
        c = rng.randrange(len(items))
        key = (items[c].title, items[c].text)
        if key in seen or any(a in _padded(items[c]) for a in every):
            continue
        seen.add(key)
        distractors.append(c)
    per = n_questions // 3
    slots: list[int] = []
    for bucket in BUCKETS:
        pool = [p for p in range(n_docs) if bucket_of(p, n_docs) == bucket]
        slots += rng.sample(pool, per)
    order: list[int | None] = [None] * n_docs
    for q, slot in zip(golds, slots):
        order[slot] = q
    rest = iter(distractors)
    order = [next(rest) if o is None else o for o in order]
    messages = [("user", NQ_SHARED_INTRO)]
    messages += [("tool", render_nq_document(i, items[j])) for i, j in enumerate(order, 1)]
    asked = list(zip(golds, slots))
    rng.shuffle(asked)
    probes = tuple(
        Probe(
            question=NQ_SHARED_ASK.format(q=items[q].question),
            answers=tuple(items[q].answers),
            bucket=bucket_of(slot, n_docs),
            where=slot,
        )
        for q, slot in asked
    )
    return Conversation(f"nq-shared-s{seed}-e{index}", tuple(messages), probes, remember=True)


@register_memory_task(
    "nq-shared",
    size="n_docs",
    questions="n_questions",
    help={
        "size": "documents (default 18)",
        "questions": "questions whose gold documents it holds, default 6",
    },
)
def nq_shared_examples(
    n_examples: int = 10, seed: int = 0, n_docs: int = 18, n_questions: int = 6
) -> list[Conversation]:
    """``n_examples`` conversations of ``n_docs`` NQ passages holding the gold passages of
    ``n_questions`` questions (a multiple of 3: as many per third), asked one after another
    and kept. Deterministic in its arguments; ids ``nq-shared-s{seed}-e{i}``.

    Raises:
        InvalidInputError: ``n_questions`` not a positive multiple of 3, more than a third of
            ``n_docs`` can place, or ``n_examples`` below 1.
    """
    if not isinstance(n_examples, int) or n_examples < 1:
        raise InvalidInputError(f"n_examples must be at least 1, not {n_examples!r}")
    if not isinstance(n_questions, int) or n_questions < 3 or n_questions % 3:
        raise InvalidInputError(
            f"n_questions must be a positive multiple of 3, not {n_questions!r}"
        )
    if not isinstance(n_docs, int) or n_docs < n_questions or n_docs // 3 < n_questions // 3:
        raise InvalidInputError(
            f"n_docs must be at least {n_questions} (the gold passages), not {n_docs!r}"
        )
    return [_conversation(i, seed, n_docs, n_questions) for i in range(n_examples)]
