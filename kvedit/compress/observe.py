"""Attention read-outs that score cache entries: what some queries give each stored entry.

Every helper runs tokens over (part of) a state with the one attention observer
(:func:`kvedit.states.observer.observed_attention`) and returns, per layer, the attention
``[batch, heads, n]`` (query heads; ``n`` the layer's entries) summed over the observing
queries. The state is never modified.

- :func:`question_attention`: a text run on top of the whole state (SnapKV's question window).
- :func:`window_attention`: the state's own last ``window`` tokens, run again at their positions
  on top of the entries before them (SnapKV's observation window; TOVA with ``window=1``).
  "Before" is by position: entries appended after the text (a re-read copy) are never seen by
  a text token run again, and score zero.
- :func:`accumulated_attention`: every token of the text, run again in chunks (H2O).
"""

from __future__ import annotations

import dataclasses

import torch

from ..cache import LayerKV
from ..errors import InvalidInputError
from ..states.observer import observed_attention
from ..states.state import KVState

__all__ = [
    "accumulated_attention",
    "prior_layers",
    "question_attention",
    "to_kv_heads",
    "window_attention",
]


def prior_layers(state: KVState, first: int) -> tuple[list[LayerKV], list[torch.Tensor]]:
    """Each layer with only the entries at positions before token ``first``'s (window lifted,
    so the observing queries see every entry it holds), and the kept entry indices ``[m]`` of
    each. Entries at later positions are never kept: the text's later tokens, and what was
    appended after the text (a re-read copy of an earlier token, a separator), which a query
    at token ``first``'s position never saw."""
    limit = int(state.position_ids[first]) if first < len(state) else state.next_position
    layers, kept = [], []
    for layer in state.layers:
        keep = (layer.positions < limit).nonzero().flatten()
        layers.append(dataclasses.replace(layer.select(keep), window=None))
        kept.append(keep)
    return layers, kept


def question_attention(state: KVState, text: str) -> dict[int, torch.Tensor]:
    """``[batch, heads, n]`` per layer: the attention ``text`` (run after the state, not added
    to it) gives each entry, summed over its tokens."""
    model, _ = state.require_model()
    ids = state.encode(text, "query")
    if not ids:
        raise InvalidInputError("the query tokenizes to nothing")
    positions = torch.arange(state.next_position, state.next_position + len(ids))
    probs = observed_attention(model, state.layers, ids, positions)
    return {i: p[..., : len(state.layers[i])] for i, p in probs.items()}


def window_attention(state: KVState, window: int) -> dict[int, torch.Tensor]:
    """``[batch, heads, n]`` per layer: the attention the state's last ``window`` tokens give
    the entries of the tokens before them, summed over the window (zeros on the window's own
    entries). The window is run again at its positions over the rest of the cache."""
    first = max(0, len(state) - window)
    return _chunk_attention(state, first, len(state), own=False)


def accumulated_attention(state: KVState, chunk: int = 512) -> dict[int, torch.Tensor]:
    """``[batch, heads, n]`` per layer: the attention every token of the text gives each entry
    (its own included), summed over all of them: H2O's accumulated attention. The text is run
    again, ``chunk`` tokens at a time over the entries of the tokens before each chunk; this
    costs one forward pass over the state and ``[batch, heads, chunk, n]`` floats per layer."""
    total: dict[int, torch.Tensor] = {}
    for start in range(0, len(state), chunk):
        part = _chunk_attention(state, start, min(len(state), start + chunk), own=True)
        for i, p in part.items():
            total[i] = p if i not in total else total[i] + p
    return total


def _chunk_attention(state: KVState, start: int, end: int, own: bool) -> dict[int, torch.Tensor]:
    """Attention of tokens ``[start, end)`` run over the entries of tokens ``< start``, mapped
    onto each layer's entries ``[batch, heads, n]``; with ``own``, also what they give each
    other (causally) on the entries of tokens ``[start, end)``, else zeros there."""
    model, _ = state.require_model()
    prior, kept = prior_layers(state, start)
    ids = state.token_ids[start:end].tolist()
    probs = observed_attention(model, prior, ids, state.position_ids[start:end])
    out = {}
    for i, layer in enumerate(state.layers):
        p = probs[i]
        full = torch.zeros(*p.shape[:2], len(layer), device=p.device)
        m = len(kept[i])
        full[..., kept[i].to(full.device)] = p[..., :m]
        if own:  # the chunk's own entries where the text holds them (not re-read copies)
            inside = (layer.token_index >= start) & (layer.token_index < end)
            text_pos = state.position_ids[layer.token_index.clamp(0, len(state) - 1)]
            mine = (inside & (layer.positions == text_pos)).nonzero().flatten()
            query_of = (layer.token_index[mine] - start).to(full.device)
            full[..., mine.to(full.device)] = p[..., m + query_of]
        out[i] = full
    return out


def to_kv_heads(probs: torch.Tensor, kv_heads: int, reduce: str = "sum") -> torch.Tensor:
    """Query-head scores ``[batch, heads, n]`` reduced over each KV head's group of query heads
    (``reduce``: ``"sum"`` or ``"max"``): ``[batch, kv_heads, n]`` (grouped-query attention
    shares a KV head among ``heads // kv_heads`` query heads)."""
    b, heads, n = probs.shape
    if heads % kv_heads:
        raise InvalidInputError(f"{heads} query heads do not group into {kv_heads} KV heads")
    grouped = probs.reshape(b, kv_heads, heads // kv_heads, n)
    if reduce == "max":
        return grouped.amax(dim=2)
    if reduce != "sum":
        raise ValueError(f"reduce is 'sum' or 'max', not {reduce!r}")
    return grouped.sum(dim=2)
