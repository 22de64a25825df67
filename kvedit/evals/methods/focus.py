"""How ``auto`` and ``reread`` call :func:`kvedit.focus` on an example.

The scoring and the bias live in :mod:`kvedit.focus`; this module only translates a method's
parameters: the passages are the example's documents, the calibration query is its question,
and ``layers`` (fractions of the depth) become layer indices.
"""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.edits import apply_edit, edited_state
from kvedit.focus import DEFAULT_GUARD, Focus, choose, focus, guarded
from kvedit.guard import AgreementGuard
from kvedit.state import KVState

__all__ = ["example_focus", "focused_answer", "focused_state", "layer_slice"]


def layer_slice(layers: tuple[float, float], n_layers: int) -> slice:
    """The layers ``[lo, hi)`` as fractions of the depth, at least one layer."""
    lo, hi = layers
    return slice(int(lo * n_layers), max(int(lo * n_layers) + 1, int(hi * n_layers)))


def guard_of(params, ctx: ExampleContext) -> AgreementGuard | None:
    """The guard ``params.guard`` asks for, answering up to ``ctx.max_new_tokens`` tokens."""
    if not params.guard:
        return None
    return AgreementGuard(DEFAULT_GUARD.margin, ctx.max_new_tokens)


def focused_state(ctx: ExampleContext, params) -> tuple[KVState | None, Focus]:
    """The state ``auto``/``reread`` answer from, and the :class:`~kvedit.focus.Focus`: the
    documents :func:`kvedit.focus.choose` picks, edited as ``params.edit`` says, kept only if
    the guard agrees (``params.guard``). The state is None for ``edit="steer"`` (it edits no
    cache)."""
    if params.edit == "emphasize":
        found = example_focus(ctx, params)
        return found.state, found
    found = example_focus(ctx, params, edit=False)
    spans = [found.passages[i] for i in found.chosen]
    edited = edited_state(ctx, spans, params)
    if edited is None:
        return None, found
    found = guarded(found, edited, guard_of(params, ctx))
    return found.state, found


def focused_answer(ctx: ExampleContext, params) -> tuple[str, Focus]:
    """The answer of ``auto``/``reread``: :func:`focused_state` continued with the question
    (for ``edit="steer"``, a steered run of the prompt)."""
    state, found = focused_state(ctx, params)
    if state is None:
        return apply_edit(ctx, [found.passages[i] for i in found.chosen], params), found
    return found.generate(ctx.max_new_tokens), found


def example_focus(ctx: ExampleContext, params, *, edit: bool = True) -> Focus:
    """:func:`kvedit.focus` (or, without ``edit``, :func:`kvedit.focus.choose`) of ``ctx``'s
    documents for its question, with ``params`` (an ``AutoParams``: ``top_k``, ``layers``,
    ``target``, ``strength``, ``guard``)."""
    n_layers = len(ctx.state.layers)
    kw = dict(
        top_k=min(params.top_k, len(ctx.doc_spans)),
        layers=range(n_layers)[layer_slice(params.layers, n_layers)],
        query=ctx.example.question,
        target=params.target,
        max_strength=params.strength,
        smoothing=params.smoothing,
    )
    if not edit:
        return choose(ctx.state, ctx.continuation, ctx.doc_spans, **kw)
    return focus(ctx.state, ctx.continuation, ctx.doc_spans, guard=guard_of(params, ctx), **kw)
