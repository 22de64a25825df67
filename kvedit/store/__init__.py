"""KVStore: a content-addressed, two-tier store of captured states, for prefix reuse and blending.

One concern per module:

- :mod:`~kvedit.store.keys`: content keys, chained hashes of token ids in chunks.
- :mod:`~kvedit.store.records`: an entry's record (:class:`EntryMeta`), which states may be
  stored, whose model made an entry.
- :mod:`~kvedit.store.lock`: the write lock (``filelock``) serialising writers, and
  :class:`~kvedit.store.lock.WriterLock`, one writer's claim on a file that names its holder.
- :mod:`~kvedit.store.layout`: the directory's layout and its configuration (``store.json``).
- :mod:`~kvedit.store.index`: one scan of the entries directory (:class:`DiskIndex`).
- :mod:`~kvedit.store.disk`: the disk tier: entries written, read, evicted, recovered.
- :mod:`~kvedit.store.ram`: the in-memory tier in front of it.
- :mod:`~kvedit.store.matching`: longest stored prefix of a prompt (:class:`PrefixMatch`).
- :mod:`~kvedit.store.store`: :class:`KVStore`, which composes them.
"""

from __future__ import annotations

from ..errors import StoreLockTimeout
from .keys import (
    CHUNK_TOKENS,
    STORE_FORMAT,
    STORE_VERSION,
    chain_root,
    chunk_hashes,
    content_key,
    tail_key,
)
from .matching import PrefixMatch
from .records import EntryMeta
from .store import KVStore

__all__ = [
    "CHUNK_TOKENS",
    "STORE_FORMAT",
    "STORE_VERSION",
    "EntryMeta",
    "KVStore",
    "PrefixMatch",
    "StoreLockTimeout",
    "chain_root",
    "chunk_hashes",
    "content_key",
    "tail_key",
]
