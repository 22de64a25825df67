"""SnapKV: entries scored by the attention an observation window gives them.

Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"
(arXiv:2404.14469). Every entry gets the attention of the observation queries, summed over
them and over the query heads that share its KV head, smoothed by a 1D max-pool of width
``kernel`` over neighbouring entries (so whole phrases survive, not isolated tokens). The
queries are the text of ``query`` when given (say, the question: run on top of the state, not
added to it), else the state's own last ``window`` tokens (run again at their positions on top
of the rest). The entries of the last ``window`` tokens score ``+inf``: they are always kept,
and so are entries appended after the text (a re-read's, the newest of the cache; no text
token saw them, so the observation window cannot score them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ... import checks
from ...errors import InvalidInputError
from ...states.state import KVState
from ..observe import question_attention, to_kv_heads, window_attention
from .base import Scorer, register_scorer

__all__ = ["SnapKV", "pool_scores"]


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[batch, heads, n]`` scores max-pooled over ``kernel`` (odd) neighbouring entries."""
    b, heads, n = scores.shape
    pooled = F.max_pool1d(scores.reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(b, heads, n)


@register_scorer("snapkv")
@dataclass(frozen=True)
class SnapKV(Scorer):
    """SnapKV's pooled observation-window attention.

    Attributes:
        query: Text whose attention scores the entries (e.g. the question), or None to use the
            state's last ``window`` tokens.
        window: The last ``window`` tokens are always kept (and observe when ``query`` is None).
        kernel: Odd width of the max-pool over neighbouring entries' scores.
    """

    reads_model: ClassVar[bool] = True  # a forward pass over the state

    query: str | None = None
    window: int = 32
    kernel: int = 5

    def __post_init__(self) -> None:
        if self.query is not None:
            checks.text("query", self.query)
        checks.count("window", self.window, minimum=1)
        kernel = checks.count("kernel", self.kernel, minimum=1)
        if kernel % 2 == 0:
            raise InvalidInputError(f"kernel must be a positive odd int, not {self.kernel!r}")

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        if self.query is not None:
            probs = question_attention(state, self.query)
        else:
            probs = window_attention(state, self.window)
        recent = max(0, len(state) - self.window)
        out = {}
        for i in layers:
            layer = state.layers[i]
            per_kv = to_kv_heads(probs[i], layer.kv_shape[1])
            pooled = pool_scores(per_kv, self.kernel)
            after_text = layer.positions > int(state.position_ids[-1])  # a re-read, say
            window = ((layer.token_index >= recent) | after_text).nonzero().flatten()
            pooled[..., window.to(pooled.device)] = float("inf")
            out[i] = pooled
        return out
