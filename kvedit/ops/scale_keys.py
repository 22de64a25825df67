"""``scale_keys``: multiply the cached keys of chosen spans.

Scaling a post-RoPE key by ``f`` scales every query's logit for it by ``f``: a
content-dependent sharpening that needs no custom kernel, so the edited cache works in any
inference engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import checks
from ..spans import Spans
from ..state import KVState, LayerKV
from ._select import edit_entries


def scale_keys(
    state: KVState,
    spans: Spans,
    factor: float,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state with the keys ``[batch, kv_heads, entries, dim]`` of ``spans`` times ``factor``."""
    factor = checks.real("factor", factor, cap=checks.MAX_SCALE_FACTOR)

    def scale(i: int, layer: LayerKV, entries: torch.Tensor) -> LayerKV:
        if factor == 1.0:
            return layer
        keys = layer.keys.clone()
        keys[:, :, entries] *= factor
        return dataclasses.replace(layer, keys=keys)

    return edit_entries(state, spans, layers, scale)
