"""``scale_keys``: multiply the cached keys of chosen spans.

Scaling a post-RoPE key by ``f`` scales every query's logit for it by ``f``: a
content-dependent sharpening that needs no custom kernel, so the edited cache works in any
inference engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..spans import Spans
from ..state import KVState
from ._select import finite, layer_set, span_tokens


def scale_keys(
    state: KVState,
    spans: Spans,
    factor: float,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state with the keys ``[batch, kv_heads, entries, dim]`` of ``spans`` times ``factor``."""
    factor = finite("factor", factor)
    tokens = span_tokens(state, spans)
    chosen = layer_set(state, layers)
    new_layers = []
    for i, layer in enumerate(state.layers):
        entries = layer.entries_for(tokens)
        if i not in chosen or entries.numel() == 0 or factor == 1.0:
            new_layers.append(layer)
            continue
        keys = layer.keys.clone()
        keys[:, :, entries.to(keys.device)] *= factor
        new_layers.append(layer.__class__(**{**layer.__dict__, "keys": keys}))
    return state.replace(layers=new_layers)
