"""The names ``kvedit``'s options list (forgetting policies, eval tasks, engines, speaker modes)
and the defaults their help states, held without importing the modules they come from: those
import torch, and every ``kvedit ... --help`` must print at once (#69).

Each constant is a copy of what kvedit's own modules register or define, named beside it;
``tests/cli/test_cli_help.py`` fails, naming the difference, where a copy and its source part
(a scorer or task added without its line here, or one listed here that is not registered).

The functions are what the parsers read: the copy, or, where the registry's module is already
imported (a program that registered a scorer or a task of its own, then called
:func:`kvedit.cli.main`), the registry itself, so that what was registered there is listed and
taken too. Nothing here imports a heavy module that is not already loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

__all__ = [
    "DEFAULT_POLICY",
    "ENGINES",
    "FALLBACK_POLICY",
    "LITM_TASKS",
    "MEMORY_TASK_HELP",
    "QUANTIZE_BITS",
    "RECENT_TOKENS",
    "SCORERS_READING_MODEL",
    "SPEAKER_MODES",
    "VLLM_BATCH",
    "litm_tasks",
    "memory_task_help",
    "memory_tasks",
    "policies",
    "servable_policies",
]

SCORERS_READING_MODEL: Mapping[str, bool] = {
    "h2o": True,
    "knorm": False,
    "reconstruct": True,
    "kvzip": True,
    "learned": False,
    "snapkv": True,
    "tova": True,
    "window": False,
}
""":data:`kvedit.compress.SCORERS` in its registration order: each scorer's name and its
``reads_model`` (whether it runs the model to score; a served memory forgets only with those
that do not). Every scorer is a forgetting policy."""

DEFAULT_POLICY = "learned"
""":data:`kvedit.memory.forgetting.DEFAULT_POLICY`: the default where a fit exists."""

FALLBACK_POLICY = "kvzip"
""":data:`kvedit.memory.forgetting.FALLBACK_POLICY`: the default where no fit exists."""

RECENT_TOKENS = 16
""":data:`kvedit.memory.budget.RECENT_TOKENS`: the last tokens no forgetting round drops."""

QUANTIZE_BITS = (2, 4, 8)
""":data:`kvedit.cache.packed.BITS`: the widths a memory quantizes its older messages to."""

LITM_TASKS = ("nq", "records")
""":data:`kvedit.evals.tasks.TASKS`' names, sorted (``kvedit eval litm --task``)."""

MEMORY_TASK_HELP: Mapping[str, Mapping[str, str]] = {
    "facts": {
        "size": "messages after the system message (even, 40-200; default 60)",
        "questions": "facts stated, default 6",
    },
    "nq-shared": {
        "size": "documents (default 18)",
        "questions": "questions whose gold documents it holds, default 6",
    },
}
""":data:`kvedit.evals.tasks.MEMORY_TASKS` in its registration order: each task's name and its
registered help (the suite's option -> what it means for the task)."""

ENGINES = ("transformers", "vllm")
""":data:`kvedit.evals.engines.ENGINES` (``kvedit eval litm --engine``)."""

VLLM_BATCH = 8
""":data:`kvedit.evals.engines.VLLM_BATCH`: examples vLLM answers in one batch."""

SPEAKER_MODES = ("user", "alternate")
""":data:`kvedit.evals.conversation_files.SPEAKER_MODES` (``kvedit eval memory --speakers``)."""

_SCORERS_MODULE = "kvedit.compress.scorers"
_TASKS_MODULE = "kvedit.evals.tasks"


def policies() -> tuple[str, ...]:
    """Every forgetting policy's name, sorted (:func:`kvedit.memory.forgetting.policies`)."""
    if _SCORERS_MODULE in sys.modules:
        from ..memory.forgetting import policies as registered

        return registered()
    return tuple(sorted(SCORERS_READING_MODEL))


def servable_policies() -> tuple[str, ...]:
    """The policies a served memory may use: those that do not run the model
    (:func:`kvedit.integrations.vllm.conversations.servable_policies`)."""
    if _SCORERS_MODULE in sys.modules:
        from ..integrations.vllm.conversations import servable_policies as registered

        return registered()
    return tuple(name for name, reads in SCORERS_READING_MODEL.items() if not reads)


def litm_tasks() -> tuple[str, ...]:
    """The lost-in-the-middle suite's task names, sorted."""
    if _TASKS_MODULE in sys.modules:
        from ..evals.tasks import TASKS

        return TASKS.names()
    return LITM_TASKS


def memory_tasks() -> dict[str, Mapping[str, str]]:
    """The memory suite's tasks: name -> its registered help, in registration order."""
    if _TASKS_MODULE in sys.modules:
        from ..evals.tasks import MEMORY_TASKS

        return {name: dict(task.help) for name, task in MEMORY_TASKS.items()}
    return {name: dict(help) for name, help in MEMORY_TASK_HELP.items()}


def memory_task_help(option: str) -> str:
    """What ``option`` means for each memory task (``"facts: ...; nq-shared: ..."``)."""
    said = [f"{name}: {help[option]}" for name, help in memory_tasks().items() if option in help]
    return "; ".join(said) or option
