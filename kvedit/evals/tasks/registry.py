"""The task registries: task name -> :class:`Task` (a generator of examples, and how the suite's
options map to its own keywords).

:data:`TASKS` holds the lost-in-the-middle suite's tasks (``kvedit eval litm --task``: options
``seed``, ``n_docs``, ``positions``, ``trials``), :data:`MEMORY_TASKS` the memory suite's
(``kvedit eval memory --task``: ``n_examples``, ``seed``, ``size``, ``questions``). Register a
generator with :func:`register_task` or :func:`register_memory_task`, naming the keyword each
option is given as where it differs (``@register_task("records", n_docs="n_records")``); the
suites and their ``--task`` choices read the registries, so a new task is one module (imported
by :mod:`kvedit.evals.tasks`) plus its test. Generators check their ``positions`` argument with
:func:`check_positions`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvedit.errors import InvalidInputError
from kvedit.registry import Registry, same_thing

__all__ = [
    "MEMORY_TASKS",
    "TASKS",
    "Task",
    "TaskFn",
    "check_positions",
    "register_memory_task",
    "register_task",
]

TaskFn = TypeVar("TaskFn", bound=Callable[..., list])


@dataclass(frozen=True)
class Task:
    """A registered task.

    Attributes:
        name: Its name (``--task``).
        make: The generator of its examples (an ``Example`` list, or a ``Conversation`` list
            for a memory task).
        keywords: The suite's option -> the generator's keyword, where they differ (an option
            not named here is given under its own name).
        help: The suite's option -> what it means for this task, in words (the CLI's help).
    """

    name: str
    make: Callable[..., list]
    keywords: Mapping[str, str] = field(default_factory=dict)
    help: Mapping[str, str] = field(default_factory=dict)

    def examples(self, **options: Any) -> list:
        """The task's examples for the suite's ``options`` (None: the generator's default).

        Raises:
            InvalidInputError: an option given that the task's generator does not take.
        """
        given = {self.keywords.get(k, k): v for k, v in options.items() if v is not None}
        params = inspect.signature(self.make).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            taken = {p.name for p in params}
            extra = [
                k
                for k, v in options.items()
                if v is not None and self.keywords.get(k, k) not in taken
            ]
            if extra:
                raise InvalidInputError(
                    f"task {self.name!r} takes no {', '.join(extra)} (it takes "
                    f"{', '.join(sorted(taken)) or 'nothing'})"
                )
        return self.make(**given)


TASKS: Registry[Task] = Registry("task")
"""The lost-in-the-middle suite's tasks by name (a :class:`kvedit.registry.Registry`)."""

MEMORY_TASKS: Registry[Task] = Registry("memory task")
"""The memory suite's tasks by name (a :class:`kvedit.registry.Registry`)."""


def _decorator(
    registry: Registry[Task], name: str, keywords: Mapping[str, str], help: Mapping[str, str]
) -> Callable[[TaskFn], TaskFn]:
    def register(make: TaskFn) -> TaskFn:
        old = registry.get(name)
        again = old is not None and same_thing(old.make, make)  # a module reloaded
        registry.register(name, Task(name, make, dict(keywords), dict(help)), replace=again)
        return make

    return register


def register_task(
    name: str, *, help: Mapping[str, str] | None = None, **keywords: str
) -> Callable[[TaskFn], TaskFn]:
    """Decorator registering a generator of :class:`~kvedit.evals.schema.Example` lists under
    ``name`` in :data:`TASKS`; ``keywords``: the suite's option -> the generator's keyword
    where they differ (``n_docs="n_records"``); ``help``: the options in words.

    Registering a function again under its own name (as a module reload does) is allowed.

    Raises:
        InvalidInputError: ``name`` is already registered to another function (a
            ``ValueError``).
    """
    return _decorator(TASKS, name, keywords, help or {})


def register_memory_task(
    name: str, *, help: Mapping[str, str] | None = None, **keywords: str
) -> Callable[[TaskFn], TaskFn]:
    """Decorator registering a generator of memory conversations under ``name`` in
    :data:`MEMORY_TASKS` (options ``n_examples``, ``seed``, ``size``, ``questions``; as
    :func:`register_task`)."""
    return _decorator(MEMORY_TASKS, name, keywords, help or {})


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
