"""Edits of a captured cache. Each op takes a :class:`~kvedit.KVState`, returns a new one, and
never touches its input.

=================  ==================================================================
``emphasize``      stored +bias (nats) on a span's keys, seen by every later query
``suppress``       stored -bias on a span's keys
``scale_keys``     multiply a span's cached keys (works in any engine, no custom kernel)
``duplicate``      append copies of a span's K/V: an exact ``log(copies+1)`` bias
``reread``         encode a span again after the end of the cache
``snapkv``         keep per KV head the entries a window/question attends to (compress)
``select``         keep per KV head the entries a scorer ranks best (kvedit.compress)
``quantize``       KIVI-style 2/4/8-bit keys (per channel) and values (per token)
``minicache``      merge adjacent deep layers' K/V pairwise (shared directions, own norms)
=================  ==================================================================
"""

from __future__ import annotations

from ..compress import select
from .duplicate import duplicate
from .emphasize import emphasize
from .minicache import MergedLayerKV, minicache
from .quantize import QuantizedLayerKV, quantize
from .reread import reread
from .scale_keys import scale_keys
from .snapkv import snapkv
from .suppress import suppress

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
