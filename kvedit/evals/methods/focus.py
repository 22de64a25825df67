"""How ``auto`` and ``reread`` call :func:`kvedit.focus` on an example.

The scoring, the choice, the bias and the guard live in :mod:`kvedit.focusing.choice`; this module only
translates a method's parameters (:func:`focus_args`): the passages are the example's
documents, the calibration query is its question, and ``layers`` (fractions of the depth)
become layer indices.

:func:`kvedit.focus` makes the choice and the edit: its own sized emphasis, or the method's
other edit (``edit="reread"``, ``"duplicate"``, ``"scale_keys"``) through its ``edit=``
argument. ``"steer"`` edits no cache: the choice comes from :func:`kvedit.choose`.
"""

from __future__ import annotations

from typing import Any

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.edits import apply_edit, edited_state
from kvedit.evals.methods.none import UNEDITED_ANSWER
from kvedit.evals.prompts import plain_answer
from kvedit.focusing import choice
from kvedit.focusing.choice import ABSTAIN_THRESHOLD, Focus
from kvedit.focusing.guard import AgreementGuard, Guard, SupportGuard
from kvedit.states.state import KVState

__all__ = ["example_focus", "focus_args", "focused_answer", "focused_state", "layer_slice"]


def layer_slice(layers: tuple[float, float], n_layers: int) -> slice:
    """The layers ``[lo, hi)`` as fractions of the depth, at least one layer."""
    lo, hi = layers
    return slice(int(lo * n_layers), max(int(lo * n_layers) + 1, int(hi * n_layers)))


AGREEMENT_GUARD = AgreementGuard()
"""The :class:`~kvedit.focusing.guard.AgreementGuard` whose margin ``guard=agreement`` uses."""


def guard_of(params, ctx: ExampleContext) -> Guard | None:
    """The guard ``params.guard`` names (``"support"``, ``"agreement"`` or ``"none"``),
    answering up to ``ctx.max_new_tokens`` tokens."""
    if params.guard == "support":  # it reads the answer as the eval scores it
        read = plain_answer if ctx.prompt_format == "plain" else None
        return SupportGuard(params.support, ctx.max_new_tokens, read, params.shared)
    if params.guard == "agreement":
        return AgreementGuard(AGREEMENT_GUARD.margin, ctx.max_new_tokens)
    return None


def focus_args(ctx: ExampleContext, params) -> dict[str, Any]:
    """The keywords of :func:`kvedit.focus` / :func:`kvedit.choose` for ``params`` (an
    ``AutoParams``: ``top_k``, ``layers``, ``target``, ``strength``, ``smoothing``,
    ``threshold``, ``all_words``) on
    ``ctx``'s documents; the question is the example's."""
    n_layers = len(ctx.state.layers)
    return dict(
        top_k=min(params.top_k, len(ctx.doc_spans)),
        layers=range(n_layers)[layer_slice(params.layers, n_layers)],
        query=ctx.example.question,
        target=params.target,
        max_strength=params.strength,
        smoothing=params.smoothing,
        threshold=getattr(params, "threshold", ABSTAIN_THRESHOLD),
        all_words=getattr(params, "all_words", True),
    )


def example_focus(ctx: ExampleContext, params, *, edit: bool = True) -> Focus:
    """``ctx``'s documents focused for its question with ``params`` (an ``AutoParams``):
    :func:`kvedit.focus` (guarded if ``params.guard``), which edits the chosen documents as
    ``params.edit`` says (its own sized emphasis for ``"emphasize"``); ``none``'s answer on
    the example, when it answered first, is focus's unedited answer (``unedited``). ``edit="steer"`` (no
    cache edit), or ``edit=False`` (the choice only), returns :func:`kvedit.choose`'s choice
    with the captured state.
    """
    args = focus_args(ctx, params)
    if not (edit and params.edits_cache):
        return choice.choose(ctx.state, ctx.continuation, ctx.doc_spans, **args)
    other = None
    if params.edit != "emphasize":

        def other(state: KVState, spans: list[tuple[int, int]]) -> KVState:
            return edited_state(ctx, spans, params, state)

    guard = guard_of(params, ctx)
    unedited = ctx.notes.get(UNEDITED_ANSWER)  # none's answer, when it answered first
    return choice.focus(
        ctx.state,
        ctx.continuation,
        ctx.doc_spans,
        guard=guard,
        edit=other,
        unedited=unedited,
        **args,
    )


def focused_state(ctx: ExampleContext, params) -> tuple[KVState | None, Focus]:
    """The state ``auto``/``reread`` answer from (None for ``edit="steer"``: it edits no
    cache), and the :class:`~kvedit.focusing.choice.Focus` of :func:`example_focus`."""
    found = example_focus(ctx, params)
    return (found.state if params.edits_cache else None), found


def focused_answer(ctx: ExampleContext, params) -> tuple[str, Focus]:
    """The answer of ``auto``/``reread``: :func:`focused_state` continued with the question
    (for ``edit="steer"``, a steered run of the prompt; the unedited answer when no document
    was chosen)."""
    found = example_focus(ctx, params)
    if not params.edits_cache and found.chosen:
        return apply_edit(ctx, [found.passages[i] for i in found.chosen], params), found
    return found.generate(ctx.max_new_tokens), found
