"""How ``auto`` and ``reread`` call :func:`kvedit.focus` on an example.

The scoring and the bias live in :mod:`kvedit.focus`; this module only translates a method's
parameters: the passages are the example's documents, the calibration query is its question,
and ``layers`` (fractions of the depth) become layer indices.
"""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.focus import Focus, choose, focus

__all__ = ["example_focus", "layer_slice"]


def layer_slice(layers: tuple[float, float], n_layers: int) -> slice:
    """The layers ``[lo, hi)`` as fractions of the depth, at least one layer."""
    lo, hi = layers
    return slice(int(lo * n_layers), max(int(lo * n_layers) + 1, int(hi * n_layers)))


def example_focus(ctx: ExampleContext, params, *, edit: bool = True) -> Focus:
    """:func:`kvedit.focus` (or, without ``edit``, :func:`kvedit.focus.choose`) of ``ctx``'s
    documents for its question, with ``params`` (an ``AutoParams``: ``top_k``, ``layers``,
    ``target``, ``strength``)."""
    n_layers = len(ctx.state.layers)
    kw = dict(
        top_k=min(params.top_k, len(ctx.doc_spans)),
        layers=range(n_layers)[layer_slice(params.layers, n_layers)],
        query=ctx.example.question,
    )
    if not edit:
        return choose(ctx.state, ctx.continuation, ctx.doc_spans, **kw)
    return focus(
        ctx.state,
        ctx.continuation,
        ctx.doc_spans,
        target=params.target,
        max_strength=params.strength,
        **kw,
    )
