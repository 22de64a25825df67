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
from ..cache import LayerKV
from ..provenance import Step
from ..spans import Spans
from ..states.state import KVState
from .entries import edit_entries

__all__ = ["scale_keys"]


def scale_keys(
    state: KVState,
    spans: Spans,
    factor: float,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state with the keys ``[batch, kv_heads, entries, dim]`` of ``spans`` times ``factor``
    (every reading of a span token, re-read copies too); the last input is recomputed and the
    history records a ``scale_keys`` step (the factor, tokens and layers)."""
    factor = checks.real("factor", factor, cap=checks.MAX_SCALE_FACTOR)

    def scale(i: int, layer: LayerKV, entries: torch.Tensor) -> LayerKV:
        if factor == 1.0:
            return layer
        keys = layer.keys.clone()
        keys[:, :, entries] *= factor
        return dataclasses.replace(layer, keys=keys)

    return edit_entries(state, spans, layers, scale, Step("edit", "scale_keys", {"factor": factor}))
