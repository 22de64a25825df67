"""``emphasize``: add a stored attention bias to the keys of chosen spans.

Every later query (question and answer tokens) sees the bias; the prompt's own pass is not
changed. This is the cache-level form of ``kvedit.steer(..., scope="decode")``. A bias of
``log(r)`` is exactly what ``duplicate(state, spans, r - 1)`` does on a stock kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import checks
from ..spans import Spans
from ..state import KVState, LayerKV
from ._select import edit_entries


def emphasize(
    state: KVState,
    spans: Spans,
    strength: float = 2.0,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state whose ``spans`` keys get ``+strength`` nats in every later query's logits.

    Biases add up with earlier edits. Only entries a layer holds are touched (sliding-window
    layers hold their last ``window - 1`` tokens). The input state is not modified.
    """
    strength = checks.strength("strength", strength)

    def add_bias(layer: LayerKV, entries: torch.Tensor) -> LayerKV:
        if strength == 0.0:
            return layer
        bias = layer.dense_bias().clone()
        bias[:, :, entries] += strength
        return dataclasses.replace(layer, bias=bias)

    return edit_entries(state, spans, layers, add_bias)


def bias_entries(state: KVState, per_layer: Sequence[torch.Tensor | None]) -> KVState:
    """A new state with ``per_layer[i]`` (``[batch, heads, n_i]`` or None) added to layer i's bias."""
    new_layers = []
    for layer, add in zip(state.layers, per_layer, strict=True):
        if add is None:
            new_layers.append(layer)
            continue
        bias = layer.dense_bias(add.shape[1] if add.shape[1] > 1 else None) + add.to(torch.float32)
        new_layers.append(dataclasses.replace(layer, bias=bias))
    return state.replace(layers=new_layers)
