"""``emphasize`` and ``suppress``: a stored attention bias on the keys of chosen spans.

Every later query (question and answer tokens) sees the bias; the prompt's own pass is not
changed. This is the cache-level form of ``kvedit.steer(..., scope="decode")``. A bias of
``log(r)`` is exactly what ``duplicate(state, spans, r - 1)`` does on a stock kernel;
``suppress`` is ``emphasize`` with the opposite sign.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import checks
from ..cache import LayerKV
from ..errors import InvalidInputError
from ..provenance import Step
from ..spans import Spans
from ..states.state import KVState
from .entries import edit_entries

__all__ = ["emphasize", "suppress"]


def emphasize(
    state: KVState,
    spans: Spans,
    strength: float | Sequence[float] = 2.0,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state whose ``spans`` keys get ``+strength`` nats in every later query's logits.

    ``strength`` is one number for every layer, or one per layer (a sequence as long as
    ``state.layers``; :func:`kvedit.focus` sizes the bias per layer). Biases add up with earlier
    edits. Only entries a layer holds are touched (sliding-window layers hold their last
    ``window`` tokens); every reading of a span token is (a re-read copy too). The last input
    is recomputed once over the edited cache. The history records an ``emphasize`` step (the
    strength, tokens and layers). The input state is not modified.
    """
    n = len(state.layers)
    if isinstance(strength, Sequence) and not isinstance(strength, str):
        if len(strength) != n:
            raise InvalidInputError(f"{len(strength)} per-layer strengths for a {n}-layer state")
        per_layer = [checks.strength(f"strength[{i}]", s) for i, s in enumerate(strength)]
        recorded: float | list[float] = per_layer
    else:
        per_layer = [checks.strength("strength", strength)] * n
        recorded = per_layer[0]
    return _biased(
        state, spans, per_layer, layers, Step("edit", "emphasize", {"strength": recorded})
    )


def suppress(
    state: KVState,
    spans: Spans,
    strength: float = 2.0,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state whose ``spans`` keys get ``-strength`` nats; see :func:`emphasize`. The
    history records a ``suppress`` step."""
    strength = checks.strength("strength", strength)
    step = Step("edit", "suppress", {"strength": strength})
    return _biased(state, spans, [-strength] * len(state.layers), layers, step)


def _biased(
    state: KVState,
    spans: Spans,
    per_layer: Sequence[float],
    layers: Sequence[int] | None,
    step: Step,
) -> KVState:
    """``per_layer[i]`` nats added to the bias of the spans' entries on layer ``i``."""

    def add_bias(i: int, layer: LayerKV, entries: torch.Tensor) -> LayerKV:
        if per_layer[i] == 0.0:
            return layer
        bias = layer.dense_bias().clone()
        bias[:, :, entries] += per_layer[i]
        return dataclasses.replace(layer, bias=bias)

    return edit_entries(state, spans, layers, add_bias, step)
