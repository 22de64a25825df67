"""Cache-layer classes: how one decoder layer's cache entries are held, in a registry.

Every class keeps ``keys``, ``values``, ``token_index``, ``positions``, ``bias`` and ``window``
readable, knows its length, device and bytes, gives dense K/V to the attention one layer at a
time (:meth:`~LayerKV.dense_kv`), selects entries, and writes and reads itself
(:meth:`~LayerKV.to_tensors` / :meth:`~LayerKV.from_tensors`, used by storage and the store).
Register a new kind with :func:`register_layer`.

==============  =========================================================================
``dense``       :class:`LayerKV`: plain tensors (:mod:`.dense`)
``quantized``   :class:`QuantizedLayerKV`: KIVI-style packed keys and values (2/4/8 bits;
                :mod:`.quantized`)
``merged``      :class:`MergedLayerKV`: one layer of a MiniCache pair, sharing its K/V
                directions with the adjacent layer (:class:`SharedDirections`,
                :mod:`.directions`; the layer in :mod:`.merged`)
``headwise``    :class:`HeadwiseLayerKV`: each KV head holds its own entries, right-aligned
                and padded (:mod:`.headwise`; a memory forgetting per head)
==============  =========================================================================

Packed classes (``packed = True``: quantized, merged) derive from :class:`PackedLayerKV`
(:mod:`.packed`): a packed part then an exact tail, one way to select and append entries, and
one on-disk layout of packed data (:class:`PackedKV`). They are expanded one layer at a time
when a forward needs them (:func:`kvedit.cache.adapter.dynamic_cache`), never all at once.
"""

from __future__ import annotations

from .dense import LayerKV
from .directions import SharedDirections
from .headwise import HeadwiseLayerKV, is_headwise, keep_per_head, refuse_headwise
from .merged import MergedLayerKV
from .packed import PackedKV, PackedLayerKV
from .quantized import QuantizedLayerKV
from .registry import LAYER_CLASSES, layer_class, register_layer

__all__ = [
    "LAYER_CLASSES",
    "HeadwiseLayerKV",
    "LayerKV",
    "MergedLayerKV",
    "PackedKV",
    "PackedLayerKV",
    "QuantizedLayerKV",
    "SharedDirections",
    "is_headwise",
    "keep_per_head",
    "refuse_headwise",
    "layer_class",
    "register_layer",
]
