"""The instructions of the built-in lost-in-the-middle tasks.

A leaf module of the suite: :class:`~kvedit.evals.schema.Example` needs
:data:`CLOSED_BOOK_INSTRUCTIONS` and the task generators (:mod:`kvedit.evals.tasks`) need the
instructions themselves. The prompt formats an example's user message is put in
(:data:`PROMPT_FORMATS`, :data:`ANSWER_CUE`, :func:`plain_answer`) are :mod:`kvedit.prompts`'s,
named here too: the serving path (:mod:`kvedit.integrations.vllm`) reads them there, below both.
"""

from __future__ import annotations

from kvedit.prompts import ANSWER_CUE, PROMPT_FORMATS, plain_answer

__all__ = [
    "ANSWER_CUE",
    "CLOSED_BOOK_INSTRUCTIONS",
    "NQ_CLOSED_BOOK_INSTRUCTION",
    "NQ_INSTRUCTION",
    "PROMPT_FORMATS",
    "RECORDS_INSTRUCTION",
    "plain_answer",
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
