"""Edits of a captured cache. Each op takes a :class:`~kvedit.KVState`, returns a new one, and
never touches its input.

=================  ==================================================================
``emphasize``      stored +bias (nats) on a span's keys, seen by every later query
``suppress``       stored -bias on a span's keys
``scale_keys``     multiply a span's cached keys (works in any engine, no custom kernel)
``duplicate``      append copies of a span's K/V: an exact ``log(copies+1)`` bias
``reread``         encode a span again after the end of the cache
=================  ==================================================================
"""

from __future__ import annotations

from .duplicate import duplicate
from .emphasize import emphasize
from .reread import reread
from .scale_keys import scale_keys
from .suppress import suppress

__all__ = ["duplicate", "emphasize", "reread", "scale_keys", "suppress"]
