"""Window: the newest entries are kept (recency).

StreamingLLM (Xiao et al., 2023, arXiv:2309.17453) keeps a window of the last tokens with the
first few (the attention sinks, which a forgetting :class:`kvedit.Memory` always keeps). An
entry's score is its token's index, the same on every KV head: the later, the better. It needs
neither the model nor a query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...states.state import KVState
from .base import Scorer, register_scorer

__all__ = ["Window"]


@register_scorer("window")
@dataclass(frozen=True)
class Window(Scorer):
    """Each entry's token index ``[batch, kv_heads, n]``: newer entries score higher."""

    reads_model: ClassVar[bool] = False

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        out = {}
        for i in layers:
            b, heads, _, _ = state.layers[i].kv_shape
            index = state.layers[i].token_index.float()
            out[i] = index[None, None].expand(b, heads, -1).clone()
        return out
