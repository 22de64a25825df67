"""The transformers cache adapter: kvedit layers as a ``DynamicCache`` a model's forward uses.

:func:`dynamic_cache` gives a dense layer a plain ``DynamicLayer`` holding its stored tensors
(set through the ``layers[i].keys/.values`` seam, never copied) and a packed layer (quantized,
merged) a :class:`PackedCacheLayer`, which expands it only while its attention runs.
:class:`CacheEntries` reads each layer's entries back after the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, DynamicLayer

from .dense import LayerKV

__all__ = ["CacheEntries", "PackedCacheLayer", "dynamic_cache"]


class PackedCacheLayer(DynamicLayer):
    """A transformers cache layer over a packed kvedit layer (``layer.packed``: quantized,
    merged): the layer's dense K/V exist only while its attention runs.

    :meth:`update` (what the model's attention calls with the new tokens' K/V) expands the
    stored entries with ``source.dense_kv(new)`` (stored entries, then every new entry so far,
    ``[batch, kv_heads, n + k, head_dim]``), returns them to the attention and keeps nothing
    of them: the layer holds only the packed source and the new entries (``new_keys`` /
    ``new_values``, full precision). Reading ``.keys`` / ``.values`` expands the layer on each
    access; assigning them (transformers' crop or beam reordering) turns it into a plain
    dense layer holding what was assigned.
    """

    def __init__(self, source: LayerKV) -> None:
        self._source: LayerKV | None = source
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        super().__init__()  # sets keys/values to None (no-ops here)
        b, h, _, d = source.kv_shape
        self.device = source.device
        dv = d  # values may have another head size (MLA); refined on the first update
        self.new_keys = torch.zeros(b, h, 0, d, device=self.device)
        self.new_values = torch.zeros(b, h, 0, dv, device=self.device)
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor | None:
        if self._source is None:
            return self._keys
        return self._source.dense_kv(self.new_keys, self.new_values)[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("_keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        if self._source is None:
            return self._values
        return self._source.dense_kv(self.new_keys, self.new_values)[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("_values", value)

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if value is None and self._source is not None:
            return  # DynamicLayer.__init__; reset() below drops the source too
        if self._source is not None:  # keep the side not assigned as it is now
            other = "_values" if name == "_keys" else "_keys"
            k, v = self._source.dense_kv(self.new_keys, self.new_values)
            setattr(self, other, v if other == "_values" else k)
            self._source = None
        setattr(self, name, value)

    def reset(self) -> None:
        self._source = None
        super().reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new entries; return the whole layer, expanded for this call only."""
        if self._source is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if self.new_keys.shape[-2] == 0:
            self.new_keys = key_states[:, :, :0].to(self.device)
            self.new_values = value_states[:, :, :0].to(self.device)
        self.new_keys = torch.cat([self.new_keys, key_states], dim=-2)
        self.new_values = torch.cat([self.new_values, value_states], dim=-2)
        return self._source.dense_kv(self.new_keys, self.new_values)

    def get_seq_length(self) -> int:
        if self._source is None:
            return super().get_seq_length()
        return len(self._source) + self.new_keys.shape[-2]

    @property
    def packed_source(self) -> LayerKV | None:
        """The packed layer this cache layer expands (None once it holds dense K/V)."""
        return self._source


def dynamic_cache(layers: Sequence[LayerKV]) -> DynamicCache:
    """A plain (all-global) ``DynamicCache`` holding the entries, without copying them.

    A dense layer is initialised through ``update`` with zero entries, then given the stored
    tensors through the ``layers[i].keys/.values`` seam. The model's own ``update``
    concatenates into new tensors, so stored tensors are never mutated. A packed layer
    (``layer.packed``) gets a :class:`PackedCacheLayer`, which expands it only while its
    attention runs: a forward over a quantized or merged state holds one layer's dense K/V
    at a time.
    """
    cache = DynamicCache()
    for i, layer in enumerate(layers):
        if layer.packed:
            cache.layers.append(PackedCacheLayer(layer))
            continue
        cache.update(layer.keys[:, :, :0], layer.values[:, :, :0], i)
        cache.layers[i].keys = layer.keys
        cache.layers[i].values = layer.values
    return cache


class CacheEntries(Sequence):
    """Each layer's entries after a forward over :func:`dynamic_cache`: item ``i`` is
    ``(keys, values)`` ``[batch, kv_heads, len + n, head_dim]`` (stored entries, then the ``n``
    new ones), expanded on access for a packed layer; :meth:`new_entries` gives only the new
    ones without expanding anything. ``drop``: trailing entries of the cache left out (the
    cache as it was ``drop`` tokens earlier, :meth:`first`)."""

    def __init__(self, cache: DynamicCache, n_layers: int, n_new: int, drop: int = 0) -> None:
        self._cache = cache
        self._n = n_layers
        self._new = n_new
        self._drop = drop

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(self._n)[i]]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        layer = self._cache.layers[i % self._n]
        source = getattr(layer, "packed_source", None)
        if source is not None:  # expanded once for both
            keys, values = source.dense_kv(layer.new_keys, layer.new_values)
        else:
            keys, values = layer.keys, layer.values
        end = keys.shape[-2] - self._drop
        return keys[:, :, :end], values[:, :, :end]

    def first(self, k: int) -> CacheEntries:
        """These entries with only the first ``k`` of the new ones (``0 <= k <= n``): the
        cache as it was after the first ``k`` new tokens (views, nothing copied)."""
        if not 0 <= k <= self._new:
            raise ValueError(f"first: k must be in [0, {self._new}], not {k}")
        return CacheEntries(self._cache, self._n, k, self._drop + self._new - k)

    def new_entries(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[batch, kv_heads, n, head_dim]`` of the new entries of layer ``i``."""
        layer = self._cache.layers[i]
        if getattr(layer, "packed_source", None) is not None:
            keys, values = layer.new_keys, layer.new_values
        else:
            keys, values = layer.keys, layer.values
        end = keys.shape[-2] - self._drop
        return keys[:, :, end - self._new : end], values[:, :, end - self._new : end]
