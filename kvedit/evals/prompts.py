"""The instructions of the built-in lost-in-the-middle tasks.

A leaf module: :class:`~kvedit.evals.schema.Example` needs :data:`CLOSED_BOOK_INSTRUCTIONS` and
the task generators (:mod:`kvedit.evals.tasks`) need the instructions themselves. It also holds
the prompt formats (:data:`PROMPT_FORMATS`) an example's user message is put in.
"""

from __future__ import annotations

__all__ = [
    "ANSWER_CUE",
    "CLOSED_BOOK_INSTRUCTIONS",
    "NQ_CLOSED_BOOK_INSTRUCTION",
    "NQ_INSTRUCTION",
    "PROMPT_FORMATS",
    "RECORDS_INSTRUCTION",
]

RECORDS_INSTRUCTION = (
    "Below are some records. Answer the question using the records. Answer with the number only."
)
NQ_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results"
    " (some of which might be irrelevant)."
)
NQ_CLOSED_BOOK_INSTRUCTION = "Write a high-quality answer for the given question."

CLOSED_BOOK_INSTRUCTIONS: dict[str, str] = {NQ_INSTRUCTION: NQ_CLOSED_BOOK_INSTRUCTION}
"""The instruction :meth:`Example.closed_book <kvedit.evals.schema.Example.closed_book>` switches
to by default: an instruction that refers to documents is replaced by one that does not."""

PROMPT_FORMATS = ("chat", "plain")
"""How an example's user message becomes the prompt
(:func:`kvedit.evals.methods.context.split_prompt`):

- ``"chat"``: the tokenizer's chat template, one user turn and the generation prompt (for
  instruct models; a tokenizer without a chat template is an error, never a silent fallback);
- ``"plain"``: the user message followed by :data:`ANSWER_CUE` (for base models).

Which one a run uses by default is the model's, :func:`kvedit.models.default_prompt`."""

ANSWER_CUE = "\nAnswer:"
"""What the ``"plain"`` format puts after the user message, so a base model continues
``"Question: ...\\nAnswer:"`` with the answer."""


def plain_answer(text: str) -> str:
    """The answer a ``"plain"`` prompt gets: the generation's first non-empty line.

    A base model answers after :data:`ANSWER_CUE`, then goes on writing more questions and
    answers of its own (``" 6451\nQuestion: ...\nAnswer: 3044"``); the metrics would read the
    numbers it invented as part of the answer. Greedy decoding makes this the same as stopping
    at the first newline."""
    stripped = text.lstrip()
    return text[: len(text) - len(stripped)] + stripped.split("\n", 1)[0]
