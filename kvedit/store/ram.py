"""The memory tier: recently used states kept ready in front of the disk, LRU by bytes.

States are kept without their model and tokenizer (bound again on every hit) and are never
copied: kvedit never mutates a state, so holding a reference is safe. Pinned entries stay
whatever the budget. The tier is safe to use from several threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from ..states.state import KVState
from .records import EntryMeta

__all__ = ["MemoryEntry", "MemoryTier"]


@dataclass
class MemoryEntry:
    """One state in memory.

    Attributes:
        state: the state, without model/tokenizer attached.
        meta: its record.
        nbytes: what its tensors take (:attr:`KVState.nbytes`).
    """

    state: KVState
    meta: EntryMeta
    nbytes: int


class MemoryTier:
    """States by key, least recently used first, within ``budget`` bytes (0: no tier)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._mutex = threading.RLock()
        self._entries: OrderedDict[str, MemoryEntry] = OrderedDict()

    def remember(self, key: str, state: KVState, meta: EntryMeta) -> None:
        """Keep ``state`` under ``key`` as the most recently used entry, then shrink to the
        budget (never evicting it); a state larger than the budget is not kept."""
        if not self.budget:
            return
        nbytes = state.nbytes
        if nbytes > self.budget:
            return
        with self._mutex:
            self._entries[key] = MemoryEntry(
                state.replace(model=None, tokenizer=None, max_positions=None), meta, nbytes
            )
            self._entries.move_to_end(key)
            self.shrink(protect=key)

    def lookup(self, key: str) -> MemoryEntry | None:
        """The entry under ``key`` (marked as just used), or None. Expiry is the caller's."""
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def pop(self, key: str) -> bool:
        """Forget ``key``; returns whether it was held."""
        with self._mutex:
            return self._entries.pop(key, None) is not None

    def set_pinned(self, key: str, pinned: bool) -> bool:
        """Mark ``key`` pinned or not; returns whether it is held. Does not shrink."""
        with self._mutex:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.meta = replace(entry.meta, pinned=pinned)
            return True

    def shrink(self, protect: str | None = None) -> None:
        """Drop least recently used unpinned entries (but ``protect``) beyond the budget."""
        with self._mutex:
            total = sum(e.nbytes for e in self._entries.values())
            for key in list(self._entries):
                if total <= self.budget:
                    break
                entry = self._entries[key]
                if entry.meta.pinned or key == protect:
                    continue
                del self._entries[key]
                total -= entry.nbytes

    def records(self) -> dict[str, EntryMeta]:
        """The records of the entries held, by key."""
        with self._mutex:
            return {k: e.meta for k, e in self._entries.items()}

    def usage(self) -> tuple[int, int]:
        """``(entries, bytes)`` held."""
        with self._mutex:
            return len(self._entries), sum(e.nbytes for e in self._entries.values())
