"""H2O: entries scored by the attention they accumulated over the whole text.

Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (arXiv:2306.14048). The "heavy hitters" are the entries that received the most
attention summed over every query of the prompt (the column sums of the causal attention
matrix), kept alongside the most recent tokens. Here an entry's score is that sum over every
text token and the query heads sharing its KV head (the text is run again in chunks, one
forward pass over the state), and the entries of the last ``window`` tokens score ``+inf``.
Early entries are seen by more queries, so the sums favour them; the recent window is what
balances that in H2O. States whose sliding-window layers no longer hold every token (Gemma-3
past its window) are refused: the re-read would lack its context on those layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ... import checks
from ...errors import UnsupportedModelError
from ...states.state import KVState
from ..observe import accumulated_attention, to_kv_heads
from .base import Scorer, register_scorer

__all__ = ["H2O"]

_SLIDING = (
    "cannot serve a model with sliding-window layers: it re-reads the whole text over the "
    "cache, and those layers forget the tokens its scores re-read (use learned, kvzip, "
    "reconstruct, snapkv, tova, knorm or window)"
)


@register_scorer("h2o")
@dataclass(frozen=True)
class H2O(Scorer):
    """Accumulated attention (heavy hitters) plus a recent window.

    Attributes:
        window: The last ``window`` tokens are always kept (0: none but the last token).
        chunk: Tokens run at once when re-reading the text (memory ``[heads, chunk, n]``).
    """

    reads_model: ClassVar[bool] = True  # a forward pass over the state

    window: int = 32
    chunk: int = 512

    def __post_init__(self) -> None:
        checks.count("window", self.window)
        checks.count("chunk", self.chunk, minimum=1)

    def refuses(self, state: KVState) -> str | None:
        if any(layer.window is not None for layer in state.layers):
            return _SLIDING
        return None

    def refuses_config(self, config) -> str | None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
            return _SLIDING
        return None

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        for i, layer in enumerate(state.layers):
            if layer.window is not None and len(layer) < len(state):
                raise UnsupportedModelError(
                    f"h2o re-reads the whole text over the cache, but sliding-window layer {i} "
                    f"keeps only its last {len(layer)} of {len(state)} tokens: the early chunks "
                    "would run without their context there"
                )
        probs = accumulated_attention(state, self.chunk)
        recent = len(state) - self.window
        out = {}
        for i in layers:
            layer = state.layers[i]
            scores = to_kv_heads(probs[i], layer.kv_shape[1])
            window = (layer.token_index >= recent).nonzero().flatten()
            scores[..., window.to(scores.device)] = float("inf")
            out[i] = scores
        return out
