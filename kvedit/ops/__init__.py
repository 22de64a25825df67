"""Edits of a captured cache. Each op takes a :class:`~kvedit.KVState`, returns a new one, and
never touches its input.

=================  ==================================================================
``emphasize``      stored +bias (nats) on a span's keys, seen by every later query
``suppress``       stored -bias on a span's keys (:mod:`.bias`)
``scale_keys``     multiply a span's cached keys (works in any engine, no custom kernel;
                   :mod:`.keys`)
``duplicate``      append copies of a span's K/V: an exact ``log(copies+1)`` bias
                   (:mod:`.duplication`)
``reread``         encode a span again after the end of the cache (:mod:`.rereading`)
``snapkv``         keep per KV head the entries a window/question attends to
``select``         keep per KV head the entries a scorer ranks best
``quantize``       KIVI-style 2/4/8-bit keys (per channel) and values (per token)
``minicache``      merge adjacent deep layers' K/V pairwise (shared directions, own norms)
=================  ==================================================================

The last four compress the cache; they live in :mod:`kvedit.compress` and are the same
functions here. Span edits share :func:`.entries.edit_entries`. No module here is named like a
function it exports, so ``kvedit.ops.<op>`` is always the function.
"""

from __future__ import annotations

from ..cache import MergedLayerKV, QuantizedLayerKV
from ..compress import minicache, quantize, select, snapkv
from .bias import emphasize, suppress
from .duplication import duplicate
from .keys import scale_keys
from .rereading import reread

__all__ = [
    "MergedLayerKV",
    "QuantizedLayerKV",
    "duplicate",
    "emphasize",
    "minicache",
    "quantize",
    "reread",
    "scale_keys",
    "select",
    "snapkv",
    "suppress",
]
