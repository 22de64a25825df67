"""The tasks of the lost-in-the-middle evaluation suite, registered by name in :data:`TASKS`.

``"records"`` (:func:`records_examples`, :mod:`kvedit.evals.tasks.records`)
    Synthetic key-value retrieval: ``n`` records "<name>'s secret number is <number>." and a
    question about the record at the gold position.
``"nq"`` (:func:`nq_examples`, :mod:`kvedit.evals.tasks.nq`)
    Multi-document question answering on NQ-Open as in Liu et al. (2024): the gold Wikipedia
    passage among distractors (the bundled data, see ``data/ATTRIBUTION.md``).

The memory suite's tasks (``kvedit eval memory``) are in :data:`MEMORY_TASKS`: ``"facts"``
(:mod:`kvedit.evals.tasks.memory_facts`) and ``"nq-shared"`` (:mod:`kvedit.evals.tasks.memory_nq`).

Add a task with :func:`register_task` or :func:`register_memory_task`
(:mod:`kvedit.evals.tasks.registry`), one module per generator, imported here: the suites and
their ``--task`` choices read the registries. This package also re-exports the example schema (:mod:`kvedit.evals.schema`) and
the JSON-lines io (:mod:`kvedit.evals.jsonl`), so ``from kvedit.evals.tasks import Example,
load_jsonl, write_jsonl`` keeps working.
"""

from __future__ import annotations

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidExampleError
from kvedit.evals.jsonl import load_jsonl, write_jsonl
from kvedit.evals.prompts import NQ_CLOSED_BOOK_INSTRUCTION, NQ_INSTRUCTION, RECORDS_INSTRUCTION
from kvedit.evals.schema import Example, score
from kvedit.evals.tasks.memory_facts import facts_examples
from kvedit.evals.tasks.memory_nq import nq_shared_examples
from kvedit.evals.tasks.nq import NQItem, load_nq, nq_examples
from kvedit.evals.tasks.records import NAMES, records_examples
from kvedit.evals.tasks.registry import (
    MEMORY_TASKS,
    TASKS,
    Task,
    register_memory_task,
    register_task,
)

__all__ = [
    "MEMORY_TASKS",
    "NAMES",
    "NQ_CLOSED_BOOK_INSTRUCTION",
    "NQ_INSTRUCTION",
    "RECORDS_INSTRUCTION",
    "TASKS",
    "Example",
    "Task",
    "InvalidExampleError",
    "NQItem",
    "atomic_write",
    "facts_examples",
    "load_jsonl",
    "load_nq",
    "nq_examples",
    "nq_shared_examples",
    "records_examples",
    "register_memory_task",
    "register_task",
    "score",
    "write_jsonl",
]
