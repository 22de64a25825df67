"""The methods, budgets and tasks of the memory suite (:mod:`kvedit.evals.memory`): specs in
the ``name:key=value`` grammar parsed and checked before any model loads, and a budget checked
against what each conversation's memory must never forget once the tokenizer renders it
(:func:`check_budgets_fit`), before anything is written or computed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvedit.errors import InvalidInputError
from kvedit.evals.methods.params import check_count, check_fraction, from_text
from kvedit.evals.tasks import MEMORY_TASKS
from kvedit.evals.tasks.memory_schema import Conversation
from kvedit.memory.quantizing import check_bits

__all__ = [
    "MEMORY_RESULTS",
    "TASKS",
    "MemoryMethod",
    "MemoryParams",
    "budget_entries",
    "build_conversations",
    "check_budgets_fit",
    "check_model_serves",
    "entries_needed",
    "full_entries",
    "memory_methods",
    "parse_budgets",
    "parse_memory_spec",
]

TASKS = MEMORY_TASKS
"""The memory suite's tasks by name (:data:`kvedit.evals.tasks.MEMORY_TASKS`)."""
MEMORY_RESULTS = ("results.json", "partial.jsonl")
"""The files of an earlier run that ``--out`` must not hold (unless --overwrite/--resume)."""

ONCE = ("reuse", "snapkv-first")
"""The methods that are not a forgetting policy: everything kept, or compressed once for the
first question."""


def memory_methods() -> tuple[str, ...]:
    """The methods by name: ``reuse``, every forgetting policy (every registered scorer,
    :func:`kvedit.memory.forgetting.policies`) and ``snapkv-first`` (module docstring)."""
    from kvedit.memory.forgetting import policies

    return (ONCE[0], *policies(), ONCE[1])


@dataclass(frozen=True)
class MemoryParams:
    """A memory method's parameters (module docstring)."""

    budget: float | None = None
    recent: int | None = None
    quantize: int | None = None
    recent_tokens: int | None = None
    per_head: bool | None = None
    in_bytes: bool = False

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_fraction("budget", self.budget, open_low=True)
        for name in ("recent", "recent_tokens"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        if self.quantize is not None:
            check_bits(self.quantize)


@dataclass(frozen=True)
class MemoryMethod:
    """A parsed spec: ``name``, its ``params`` and the ``spec`` text (the key in results)."""

    name: str
    params: MemoryParams
    spec: str

    def budgets(self, budgets: Sequence[float]) -> list[float]:
        """The budgets this method runs at: ``reuse`` at 1.0, a ``budget=`` at that one."""
        if self.name == "reuse":
            return [1.0]
        if self.params.budget is not None:
            return [float(self.params.budget)]
        return [float(b) for b in budgets]

    def recent_tokens(self) -> int:
        """The memory's ``recent_tokens`` (its default unless the spec gives one)."""
        from kvedit.memory.budget import RECENT_TOKENS

        given = self.params.recent_tokens
        return RECENT_TOKENS if given is None else given

    def memory_keywords(self) -> dict:
        """The ``Memory`` keywords the spec gives (the rest left at the memory's defaults)."""
        out = {"forget": self.name}
        for key in ("recent", "recent_tokens", "per_head", "quantize"):
            if getattr(self.params, key) is not None:
                out[key] = getattr(self.params, key)
        return out


def parse_memory_spec(spec: str) -> MemoryMethod:
    """``"name:key=value:..."`` -> a :class:`MemoryMethod` (names: :func:`memory_methods`).

    Raises:
        InvalidInputError: an unknown method or parameter, a bad value (``quantize`` not 2, 4
            or 8), a ``reuse`` with a budget below 1, or a policy whose scorer is not
            registered.
    """
    name, *parts = spec.strip().split(":")
    if name not in memory_methods():
        raise InvalidInputError(
            f"unknown memory method {name!r}; known: {', '.join(memory_methods())}"
        )
    texts = {}
    for part in parts:
        if "=" not in part:
            raise InvalidInputError(f"bad method spec {spec!r}: expected key=value after ':'")
        key, value = part.split("=", 1)
        texts[key.strip()] = value.strip()
    params = from_text(MemoryParams, texts, name)
    if name == "reuse" and params.budget is not None and params.budget != 1:
        raise InvalidInputError(
            f"method {spec!r}: reuse forgets nothing, so its budget is 1; name a policy "
            f"(window, knorm, ...) for budget {params.budget}"
        )
    return MemoryMethod(name, params, spec.strip())


def parse_budgets(text: str) -> list[float]:
    """``--budgets``: comma-separated fractions in (0, 1], e.g. ``1.0,0.5,0.25,0.1``."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise InvalidInputError(f"--budgets {text!r}: give fractions such as 1.0,0.5,0.25")
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise InvalidInputError(f"--budgets: {item!r} is not a number") from None
        if not math.isfinite(value) or not 0 < value <= 1:
            raise InvalidInputError(
                f"--budgets: {item} is not in (0, 1] (a fraction of the conversation's entries)"
            )
        if value in out:
            raise InvalidInputError(f"--budgets: {item} is given twice")
        out.append(value)
    return out


def build_conversations(
    task: str,
    n_examples: int,
    seed: int,
    size: int | None = None,
    questions: int | None = None,
) -> list[Conversation]:
    """The conversations of the registered memory task ``task``
    (:data:`~kvedit.evals.tasks.MEMORY_TASKS`), each option given as its own keyword: ``size``
    (``facts``: messages after the system message, default 60; ``nq-shared``: documents,
    default 18) and ``questions`` per conversation (default 6); None: the task's default.

    Raises:
        InvalidInputError: an unknown task (naming the known ones), or sizes it refuses.
    """
    return MEMORY_TASKS.lookup(task).examples(
        n_examples=n_examples, seed=seed, size=size, questions=questions
    )


def check_model_serves(model_name: str, methods: Sequence[MemoryMethod]) -> None:
    """Refuse, before the model loads, a policy whose scorer cannot serve ``model_name``
    where the model's configuration alone says so (:meth:`kvedit.compress.Scorer.refuses_config`:
    ``h2o`` on a model with sliding-window layers, Gemma-3). The configuration is read only
    when an asked scorer has such a rule; where it cannot be read, the memory refuses after
    the model loads, as before.

    Raises:
        InvalidInputError: naming the method, the model and why.
    """
    from kvedit.compress import Scorer, make_scorer
    from kvedit.evals.configs import peek_config

    scorers = {m.spec: make_scorer(m.name) for m in methods if m.name not in ONCE}
    ruled = {
        s: sc for s, sc in scorers.items() if type(sc).refuses_config is not Scorer.refuses_config
    }
    config = peek_config(model_name) if ruled else None
    if config is None:
        return
    for spec, scorer in ruled.items():
        why = scorer.refuses_config(config)
        if why is not None:
            raise InvalidInputError(f"--methods {spec} on {model_name}: {why}")


def full_entries(memory_renderer, conversation: Conversation) -> int:
    """The global-layer entries a memory that forgets nothing holds when the first question
    is asked: the tokens of the conversation's rendering."""
    from kvedit.memory.rendering import Message

    messages = [Message(role, content) for role, content in conversation.messages]
    return len(memory_renderer.render(messages).ids)


def budget_entries(budget: float, full: int) -> int | None:
    """The memory's ``max_tokens`` at ``budget`` of ``full`` entries (None at 1.0: no budget)."""
    return None if budget >= 1 else max(1, round(budget * full))


def entries_needed(
    renderer, conversation: Conversation, recent_tokens: int, max_new_tokens: int
) -> tuple[int, int]:
    """``(needed, full)``: the entries a :class:`kvedit.Memory` with ``recent_tokens`` must be
    allowed to hold for ``conversation`` (``max_tokens`` below it is refused by the memory,
    after the model loads), and :func:`full_entries`. As ``Memory`` fits its budget after
    each message: what it never forgets once the message is added
    (:func:`kvedit.memory.budget.never_forgotten`); a question and its answer come on top.
    ``max_new_tokens`` is not needed by an entry budget (kept for the callers' signature)."""
    from kvedit.memory.budget import never_forgotten
    from kvedit.memory.rendering import Message

    messages = [Message(role, content) for role, content in conversation.messages]
    ends, rendering = [0], None
    for k in range(len(messages)):
        rendering = renderer.render(messages[: k + 1], after=rendering)
        ends.append(len(rendering.ids))
    system = [(ends[j], ends[j + 1]) for j, m in enumerate(messages) if m.role == "system"]
    needed = max(
        never_forgotten(ends[k + 1], [r for r in system if r[1] <= ends[k + 1]], recent_tokens)
        for k in range(len(messages))
    )
    return needed, ends[-1]


def check_budgets_fit(
    renderer,
    conversations: Sequence[Conversation],
    pairs: Sequence[tuple[MemoryMethod, float]],
    task: str,
    max_new_tokens: int,
) -> None:
    """Refuse a method at a budget whose memory could not hold, for one of ``conversations``,
    what it never forgets (:func:`entries_needed`); ``renderer`` renders as the memories will.

    Raises:
        InvalidInputError: naming the method, the budget, the conversation, the entries the
            budget gives and those needed, and the smallest budget that would do.
    """
    needs: dict[tuple[str, int], tuple[int, int]] = {}
    for method, budget in pairs:
        if method.name in ONCE or budget >= 1 or method.params.in_bytes:
            continue  # nothing forgotten, or compressed once, or a byte budget (told at its add)
        recent = method.recent_tokens()
        for conv in conversations:
            key = (conv.id, recent)
            if key not in needs:
                needs[key] = entries_needed(renderer, conv, recent, max_new_tokens)
            needed, full = needs[key]
            held = budget_entries(budget, full)
            if held < needed:
                raise InvalidInputError(
                    f"{method.spec} at budget {budget:g}: its memory would hold {held:,} of "
                    f"{conv.id}'s {full:,} entries, fewer than the {needed:,} it never forgets "
                    f"(the first tokens, the system message, the last {recent} tokens); give a "
                    f"budget of at least {math.ceil(1000 * needed / full) / 1000:g}"
                )
