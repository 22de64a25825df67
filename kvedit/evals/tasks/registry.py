"""The task registry: task name -> function returning that task's examples.

Register a generator with :func:`register_task`; generators check their ``positions`` argument
with :func:`check_positions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvedit.errors import InvalidInputError
from kvedit.evals.schema import Example
from kvedit.registry import Registry

__all__ = ["TASKS", "TaskFn", "check_positions", "register_task"]

TaskFn = TypeVar("TaskFn", bound=Callable[..., list[Example]])

TASKS: Registry[Callable[..., list[Example]]] = Registry("task")
"""Task name -> function returning that task's examples (keyword arguments vary by task; a
:class:`kvedit.registry.Registry`)."""


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """Decorator registering a function that returns examples under ``name`` in :data:`TASKS`.

    Registering a function again under its own name (as a module reload does) is allowed.

    Raises:
        InvalidInputError: ``name`` is already registered to another function (a
            ``ValueError``).
    """
    return TASKS.decorator(name)


def check_positions(positions: Sequence[int], n_documents: int) -> tuple[int, ...]:
    """``positions`` as a tuple, checked: non-empty, distinct, each in ``[0, n_documents)``.

    Raises:
        InvalidInputError: one of those does not hold.
    """
    positions = tuple(positions)
    if not positions:
        raise InvalidInputError("positions must not be empty")
    bad = [p for p in positions if not 0 <= p < n_documents]
    if bad:
        raise InvalidInputError(f"positions {bad} are out of range for {n_documents} documents")
    if len(set(positions)) != len(positions):
        raise InvalidInputError(f"positions must be distinct, got {list(positions)}")
    return positions
