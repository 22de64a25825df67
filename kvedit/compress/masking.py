"""Per-head selection stored as a masked union of entries.

A layer's entries (``token_index``, ``positions``) are shared by its KV heads, but a selection
(SnapKV, AdaKV...) keeps *different* entries per head. kvedit stores, physically, the union of
the entries any head keeps, and masks each head's dropped entries with the :data:`DROPPED` bias
(a ``[batch, kv_heads or heads, n]`` stored bias): attention is exactly per-head selection, and
every other op and the storage format keep working. The memory saved is ``1 - union / n``
(plus the bias, 4 bytes per entry and bias head), less than the nominal ``1 - keep`` when heads
disagree.
"""

from __future__ import annotations

import dataclasses

import torch

from ..cache import LayerKV

__all__ = ["DROPPED", "live_entries", "masked_union"]

DROPPED = -1e30
"""Bias of an entry a head dropped: ``exp(-1e30)`` is exactly 0 in every float type, and unlike
``-inf`` it stays finite under arithmetic (``0 * bias`` is 0, not NaN)."""


def live_entries(layer: LayerKV, kv_heads: int) -> torch.Tensor:
    """``[batch, kv_heads, n]`` bool: the entries each KV head still attends to (not masked by
    :data:`DROPPED` for every query head of its group)."""
    if layer.bias is None:
        b, n = layer.kv_shape[0], len(layer)
        return torch.ones(b, kv_heads, n, dtype=torch.bool, device=layer.device)
    alive = layer.bias > DROPPED / 2  # [batch, kv_heads or heads, n]
    b, heads, n = alive.shape
    if heads == kv_heads:
        return alive
    return alive.reshape(b, kv_heads, heads // kv_heads, n).any(dim=2)


def masked_union(layer: LayerKV, kept: torch.Tensor) -> LayerKV:
    """``layer`` holding only the entries some head keeps, each head's others masked.

    Args:
        layer: the layer to cut (not modified); any cache-layer class with ``select``.
        kept: ``[batch, kv_heads, n]`` bool, the entries each KV head keeps.

    Returns:
        ``layer.select(union)`` with a ``[batch, kv_heads or heads, m]`` bias: the layer's own
        bias on the kept entries, :data:`DROPPED` where a head dropped an entry of the union.
    """
    kv_heads = kept.shape[1]
    union = kept.any(dim=1).any(dim=0).nonzero().flatten().cpu()  # [m] entries, in order
    u = union.to(layer.device)
    bias_heads = layer.bias.shape[1] if layer.bias is not None else kv_heads
    bias = layer.dense_bias(bias_heads)[..., u].clone()
    dropped = ~kept[..., u.to(kept.device)]  # [batch, kv_heads, m]
    if bias_heads != kv_heads:
        dropped = dropped.repeat_interleave(bias_heads // kv_heads, dim=1)
    bias = bias.masked_fill(dropped.to(bias.device), DROPPED)
    return dataclasses.replace(layer.select(union), bias=bias)
