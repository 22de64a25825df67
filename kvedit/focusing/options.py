"""The arguments of :func:`kvedit.focus` and :func:`kvedit.choose`, checked once, at the public
entry: :func:`focus_options` (everything that needs no state: how many passages, the sizing,
the smoothing and threshold, the guard, the edit, a known unedited answer) and :func:`asked`
(the question and its query, as given). What the entry hands inward is typed
(:class:`FocusOptions`, a ``str`` question) and not checked again; what needs the state (the
default query, the passages, ``top_k`` against their number, the layers) is checked where the
state is read, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import checks
from ..errors import InvalidInputError, InvalidTypeError
from ..states.decoding import Answer
from ..states.state import KVState
from .edits import check_edit
from .guard import Guard, SupportGuard, check_guard
from .passages import Range
from .scoring import ABSTAIN_THRESHOLD, SCORE_SMOOTHING, content_question

__all__ = ["DEFAULT_GUARD", "FocusOptions", "asked", "focus_options", "query_name"]

DEFAULT_GUARD = SupportGuard()
"""The answer guard :func:`kvedit.focus` applies by default
(:class:`kvedit.focusing.guard.SupportGuard` at its
:data:`~kvedit.focusing.guard.SUPPORT_THRESHOLD`): no edit where the unedited answer already
comes from the chosen passage."""


@dataclass(frozen=True)
class FocusOptions:
    """:func:`kvedit.focus`'s arguments that need no state, checked (:func:`focus_options`;
    see :func:`kvedit.focus` for each). ``top_k`` is at least 1; that it is at most the number
    of passages is checked once they are cut."""

    top_k: int = 1
    target: float | None = 0.2
    max_strength: float = 5.0
    smoothing: float = SCORE_SMOOTHING
    threshold: float | None = ABSTAIN_THRESHOLD
    all_words: bool = True
    guard: Guard | None = DEFAULT_GUARD
    edit: Callable[[KVState, list[Range]], KVState] | None = None
    unedited: Answer | None = None


def focus_options(
    *,
    top_k: int = 1,
    target: float | None = 0.2,
    max_strength: float = 5.0,
    smoothing: float = SCORE_SMOOTHING,
    threshold: float | None = ABSTAIN_THRESHOLD,
    all_words: bool = True,
    guard: Guard | None = DEFAULT_GUARD,
    edit: Callable[[KVState, list[Range]], KVState] | None = None,
    unedited: Answer | None = None,
) -> FocusOptions:
    """The :class:`FocusOptions` of these arguments, each checked before any work.

    Raises:
        InvalidInputError: a value out of range (``top_k`` under 1, ``target`` outside
            ``(0, 1)``, a negative ``max_strength`` with a target, ``smoothing`` outside
            ``(0, 1]``).
        InvalidTypeError: a value of the wrong type; ``edit`` not callable as
            ``edit(state, spans)``; ``guard`` not a guard
            (:func:`~kvedit.focusing.guard.check_guard`); ``unedited`` not an
            :class:`~kvedit.states.decoding.Answer`.
    """
    check_edit(edit)
    guard = check_guard(guard)
    if unedited is not None and not isinstance(unedited, Answer):
        raise InvalidTypeError(
            f"unedited must be a kvedit Answer (KVState.answer), not {checks.describe(unedited)}"
        )
    if target is not None:
        target = checks.real("target", target)
        if not 0.0 < target < 1.0:
            raise InvalidInputError(f"target share must be in (0, 1), not {target!r}")
    max_strength = checks.strength("max_strength", max_strength)
    if target is not None and max_strength < 0:
        raise InvalidInputError(f"max_strength must be >= 0 with a target, not {max_strength}")
    smoothing = checks.real("smoothing", smoothing)
    if not 0.0 < smoothing <= 1.0:
        raise InvalidInputError(f"smoothing must be in (0, 1], not {smoothing!r}")
    threshold = None if threshold is None else checks.real("threshold", threshold)
    all_words = checks.flag("all_words", all_words)
    top_k = checks.count("top_k", top_k, minimum=1)
    return FocusOptions(
        top_k, target, max_strength, smoothing, threshold, all_words, guard, edit, unedited
    )


def query_name(question: str, query: str) -> str:
    """What a query is called in a refusal: ``"question"`` when it is the whole question
    (stripped), else ``"query"``."""
    return "question" if query.strip() == question.strip() else "query"


def asked(question: str, query: str | None) -> tuple[str, str | None]:
    """``(question, query)`` as given to :func:`kvedit.focus`, checked: the question a
    non-empty ``str``, a given query one with content
    (:func:`~kvedit.focusing.scoring.content_question`). A query of ``None`` stays ``None``:
    the default (:func:`~kvedit.focusing.scoring.default_query`) needs the state's tokenizer.

    Raises:
        InvalidTypeError: the question or the query is not a ``str``.
        InvalidInputError: an empty question, or a query with no content.
    """
    question = checks.text("question", question, allow_empty=False)
    if query is not None:
        name = query_name(question, query) if isinstance(query, str) else "query"
        query = content_question(name, query)
    return question, query
