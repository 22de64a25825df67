"""Edits of a captured cache. Each op takes a :class:`~kvedit.KVState`, returns a new one, and
never touches its input.

=================  ==================================================================
``emphasize``      stored +bias (nats) on a span's keys, seen by every later query
``suppress``       stored -bias on a span's keys
``scale_keys``     multiply a span's cached keys (works in any engine, no custom kernel)
``duplicate``      append copies of a span's K/V: an exact ``log(copies+1)`` bias
``reread``         encode a span again after the end of the cache
``snapkv``         keep per KV head the entries a window/question attends to (compress)
``quantize``       KIVI-style 2/4/8-bit keys (per channel) and values (per token)
=================  ==================================================================
"""

from __future__ import annotations

from .duplicate import duplicate
from .emphasize import emphasize
from .quantize import QuantizedLayerKV, quantize
from .reread import reread
from .scale_keys import scale_keys
from .snapkv import snapkv
from .suppress import suppress

__all__ = [
    "QuantizedLayerKV",
    "duplicate",
    "emphasize",
    "quantize",
    "reread",
    "scale_keys",
    "snapkv",
    "suppress",
]
