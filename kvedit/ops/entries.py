"""Which entries of which layers an edit touches: the span-edit helpers the ops share.

:func:`edit_entries` applies a per-layer edit to the entries of some spans' tokens,
recomputes the state's last input and records the op's step in the history; :func:`span_tokens` and :func:`layer_set` validate an op's spans
and layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import checks
from ..cache import LayerKV, refuse_headwise
from ..errors import EmptySelectionError
from ..provenance import Step, token_ranges
from ..spans import Spans
from ..states.passes import last_input_entries, recompute_last
from ..states.state import KVState

__all__ = ["edit_entries", "layer_set", "span_tokens"]


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
    step: Step,
) -> KVState:
    """A new state with ``edit(i, layer, entries)`` applied to every chosen layer ``i`` holding a
    token of ``spans`` (``entries``: the layer's entry indices of those tokens, on its device),
    then the last input recomputed over the edited cache (:func:`~kvedit.states.passes.recompute_last`),
    so the edit reaches the next token, and ``step`` recorded in the history (with the tokens
    and layers it touched). Every reading of a span token is edited: the text token's entries
    and its re-read copies. Layers holding none of the tokens (e.g. sliding-window layers past
    the span) are kept as they are; an edit that changes nothing returns at once (no step).
    """
    refuse_headwise(state.layers, f"the {step.name} edit")
    tokens = span_tokens(state, spans)
    chosen = layer_set(state, layers)

    def apply(st: KVState, skip_last: bool) -> KVState:
        new_layers = []
        for i, layer in enumerate(st.layers):
            hit = torch.isin(layer.token_index, tokens.to(layer.token_index.device))
            if skip_last:  # the last input's entries: edited after they are recomputed
                hit &= ~last_input_entries(st, layer)
            entries = hit.nonzero().flatten()
            if i not in chosen or entries.numel() == 0:
                new_layers.append(layer)
            else:
                new_layers.append(edit(i, layer, entries.to(layer.keys.device)))
        return st.replace(layers=new_layers)

    trial = apply(state, skip_last=False)
    if all(a is b for a, b in zip(trial.layers, state.layers, strict=True)):
        return trial  # nothing changed (e.g. strength 0)
    params = {
        **step.params,
        "tokens": token_ranges(tokens),
        "layers": None if layers is None else sorted(chosen),
    }
    step = Step(step.kind, step.name, params, step.exact)
    if not bool(torch.isin(torch.tensor([state.last_input.token_index]), tokens)):
        return recompute_last(trial).with_step(step)
    edited = apply(state, skip_last=True)
    return recompute_last(
        edited, lambda i, layer, entries: edit(i, layer, entries) if i in chosen else layer
    ).with_step(step)
