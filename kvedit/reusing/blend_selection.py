"""Which tokens a blend recomputes: the deviation of the blended cache from a real forward at
one layer (:func:`deviation`, CacheBlend's selection), and the selection the blend rules make
from it (:func:`selection`). :func:`kvedit.reusing.blending.blend` calls them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..cache import LayerKV
from ..compat import cache_kwarg
from ..errors import UnsupportedModelError
from .blend_rules import BlendRules, Narrowing, deviation_scores


def _deviation_layer(layers: Sequence[LayerKV]) -> int:
    """The first global layer after layer 0 (layer 0's K/V cannot deviate), else layer 1."""
    for i, layer in enumerate(layers):
        if i >= 1 and layer.window is None:
            return i
    return min(1, len(layers) - 1)


def selection(
    model: PreTrainedModel,
    ids: torch.Tensor,
    layers: Sequence[LayerKV],
    starts: Sequence[int],
    recompute: float,
    rules: BlendRules,
) -> tuple[torch.Tensor, Narrowing | None, int | None]:
    """The tokens to recompute (ascending), their narrowing (``gradual``) and the deviation
    layer (None when no deviation pass ran): every token at ``recompute`` 1, none at 0 unless
    a rule forces some, else the ``ceil(recompute * n)`` of largest deviation and the last."""
    n = len(ids)
    n_select = 0 if recompute <= 0 else n if recompute >= 1 else max(1, math.ceil(recompute * n))
    forced = rules.forced_tokens(starts)  # recomputed whatever their deviation (leading)
    deviation_layer, narrowing = None, None
    if n_select == n:
        selected = torch.arange(n)
    elif n_select == 0 and not len(forced):
        selected = torch.empty(0, dtype=torch.long)
    else:
        scores = torch.zeros(n)
        if n_select:
            deviation_layer = _deviation_layer(layers)
            scores = deviation(model, ids, layers[deviation_layer], deviation_layer)
        scores[-1] = float("inf")  # the last token's logits start the continuation
        selected, narrowing = rules.selection(
            scores, max(1, n_select), forced, deviation_layer, len(layers)
        )
    return selected, narrowing, deviation_layer


class _Stop(Exception):
    """Raised by :class:`_CacheUpTo` to end a forward pass once it has what it needs."""


class _CacheUpTo(DynamicCache):
    """A cache that ends the forward pass (:class:`_Stop`) once layer ``last`` is cached: its
    keys and values are then known, and nothing after them (its attention, MLP, later layers)
    needs to run."""

    def __init__(self, last: int):
        super().__init__()
        self.last = last

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.last:
            raise _Stop
        return out


def true_kv(model: PreTrainedModel, ids: torch.Tensor, layer: int):
    """Keys and values ``[1, kv_heads, n, head_dim]`` of ``layer`` in a real forward over ``ids``.

    Runs the decoder only until ``layer`` has cached its keys and values.
    """
    decoder = model.get_decoder()
    cache = _CacheUpTo(layer)
    device = next(model.parameters()).device
    try:
        decoder(
            input_ids=ids[None].to(device),
            position_ids=torch.arange(len(ids), device=device)[None],
            use_cache=True,
            **{cache_kwarg(decoder): cache},
        )
    except _Stop:
        return cache.layers[layer].keys, cache.layers[layer].values
    raise UnsupportedModelError(
        f"{type(model).__name__}: the forward pass never cached layer {layer}"
    )  # pragma: no cover


def deviation(
    model: PreTrainedModel, ids: torch.Tensor, blended: LayerKV, layer: int
) -> torch.Tensor:
    """``[n]`` normalised K+V deviation of the blended cache from a real forward at ``layer``."""
    true_k, true_v = true_kv(model, ids, layer)
    entries = blended.token_index.to(true_k.device)
    scores = deviation_scores(
        blended.keys, blended.values, true_k[:, :, entries], true_v[:, :, entries]
    )
    out = torch.zeros(len(ids), dtype=torch.float32)
    out[blended.token_index] = scores.cpu()
    return out
