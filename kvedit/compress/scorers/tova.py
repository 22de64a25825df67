"""TOVA: entries scored by the attention of the last token.

Oren et al., 2024, "Transformers are Multi-State RNNs" (arXiv:2401.06104). TOVA drops, at each
step, the entry the current query attends to least, with the attention averaged over the
layer's heads; applied once to a captured cache (as kvpress's ``TOVAPress``), an entry's score
is the attention the state's last token gives it, averaged over all query heads, the same for
every KV head. The last token is run again at its position over the rest of the cache; its own
entries score ``+inf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...states.state import KVState
from ..observe import window_attention
from .base import Scorer, register_scorer

__all__ = ["TOVA"]


@register_scorer("tova")
@dataclass(frozen=True)
class TOVA(Scorer):
    """The last token's attention, averaged over the layer's query heads."""

    reads_model: ClassVar[bool] = True  # a forward pass over the state

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        probs = window_attention(state, 1)
        last = len(state) - 1
        out = {}
        for i in layers:
            layer = state.layers[i]
            kv_heads = layer.kv_shape[1]
            mean = probs[i].mean(dim=1, keepdim=True)  # [batch, 1, n] over query heads
            scores = mean.expand(-1, kv_heads, -1).clone()
            mine = (layer.token_index == last).nonzero().flatten()
            scores[..., mine.to(scores.device)] = float("inf")
            out[i] = scores
        return out
