"""KNorm: entries with low key norms are kept.

Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(arXiv:2406.11430), as kvpress's ``KnormPress``: keys with a small L2 norm tend to get high
attention, so an entry's score is minus its key's norm, per KV head. It needs neither the model
nor a query (rotary embeddings keep norms, so post-RoPE keys score as pre-RoPE ones would).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...states.state import KVState
from .base import Scorer, register_scorer

__all__ = ["KNorm"]


@register_scorer("knorm")
@dataclass(frozen=True)
class KNorm(Scorer):
    """Minus the L2 norm of each cached key ``[batch, kv_heads, n]``."""

    reads_model: ClassVar[bool] = False

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        return {i: -state.layers[i].keys.float().norm(dim=-1) for i in layers}
