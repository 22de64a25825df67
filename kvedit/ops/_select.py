"""Shared selection logic for ops: which entries of which layers an edit touches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import checks
from ..errors import EmptySelectionError
from ..spans import Spans
from ..state import KVState, LayerKV, recompute_last


def span_tokens(state: KVState, spans: Spans) -> torch.Tensor:
    """Token indices of ``spans`` in ``state.text``; raises if a span is missing or selects nothing."""
    idx = state.token_indices(spans)
    if idx.numel() == 0:
        raise EmptySelectionError(f"spans {spans!r} select no token of the state")
    return idx


def layer_set(state: KVState, layers: Sequence[int] | None) -> set[int]:
    """Validated layer indices (all layers when None); an empty list is refused."""
    n = len(state.layers)
    chosen = checks.layers(layers, n)
    return set(range(n)) if chosen is None else set(chosen)


def edit_entries(
    state: KVState,
    spans: Spans,
    layers: Sequence[int] | None,
    edit: Callable[[int, LayerKV, torch.Tensor], LayerKV],
) -> KVState:
    """A new state with ``edit(i, layer, entries)`` applied to every chosen layer ``i`` holding a
    token of ``spans`` (``entries``: the layer's entry indices of those tokens, on its device),
    then the last token recomputed over the edited cache (:func:`~kvedit.state.recompute_last`),
    so the edit reaches the next token. Layers holding none of the tokens (e.g. sliding-window
    layers past the span) are kept as they are; an edit that changes nothing returns at once.
    """
    tokens = span_tokens(state, spans)
    chosen = layer_set(state, layers)

    def apply(st: KVState, toks: torch.Tensor) -> KVState:
        new_layers = []
        for i, layer in enumerate(st.layers):
            entries = layer.entries_for(toks)
            if i not in chosen or entries.numel() == 0:
                new_layers.append(layer)
            else:
                new_layers.append(edit(i, layer, entries.to(layer.keys.device)))
        return st.replace(layers=new_layers)

    trial = apply(state, tokens)
    if all(a is b for a, b in zip(trial.layers, state.layers, strict=True)):
        return trial  # nothing changed (e.g. strength 0)
    last = len(state) - 1
    body = tokens[tokens != last]
    edited = apply(state, body) if body.numel() else state
    if body.numel() == tokens.numel():
        return recompute_last(edited)
    return recompute_last(
        edited, lambda i, layer, entries: edit(i, layer, entries) if i in chosen else layer
    )
