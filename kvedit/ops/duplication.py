"""``duplicate``: append copies of a span's K/V entries at the same positions.

``copies`` extra copies of a key multiply its unnormalised attention weight by
``copies + 1``: an exact ``log(copies + 1)`` bias that a stock attention kernel computes, as long
as later tokens get their true ``position_ids`` (which ``KVState`` always passes).

Sliding-window layers are skipped: appending entries there would push real tokens out of the
window. On Gemma-3 only the global layers get the boost.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import checks
from ..provenance import Step, token_ranges
from ..spans import Spans
from ..states.passes import recompute_last
from ..states.state import KVState
from .entries import layer_set, span_tokens

__all__ = ["duplicate"]


def duplicate(
    state: KVState, spans: Spans, copies: int = 1, layers: Sequence[int] | None = None
) -> KVState:
    """A new state with ``copies`` extra copies of ``spans``' entries on every chosen global
    layer (``layers``: default all; sliding-window layers are always skipped).

    ``copies`` is at most :data:`kvedit.checks.MAX_DUPLICATE_COPIES` (64, a bias of
    ``log 65`` = 4.2 nats; use ``emphasize`` for more). The last input is then recomputed over
    the edited cache (the edit reaches the next token), and the history records a ``duplicate``
    step (copies, tokens and layers).
    """
    copies = checks.count("copies", copies, maximum=checks.MAX_DUPLICATE_COPIES)
    chosen = layer_set(state, layers)
    tokens = span_tokens(state, spans)
    if copies == 0:
        return state.replace()
    new_layers = []
    for i, layer in enumerate(state.layers):
        entries = layer.entries_for(tokens)
        if i not in chosen or layer.window is not None or entries.numel() == 0:
            new_layers.append(layer)
            continue
        e = entries.to(layer.keys.device)
        new_layers.append(
            layer.append(
                layer.keys[:, :, e].repeat(1, 1, copies, 1),
                layer.values[:, :, e].repeat(1, 1, copies, 1),
                layer.token_index[entries].repeat(copies),
                layer.positions[entries].repeat(copies),
                None if layer.bias is None else layer.bias[..., e].repeat(1, 1, copies),
            )
        )
    if all(a is b for a, b in zip(new_layers, state.layers, strict=True)):
        return state.replace()  # no global layer holds a token of the spans: nothing copied
    step = Step(
        "edit",
        "duplicate",
        {
            "copies": copies,
            "tokens": token_ranges(tokens),
            "layers": None if layers is None else sorted(chosen),
        },
    )
    return recompute_last(state.replace(layers=new_layers)).with_step(step)
