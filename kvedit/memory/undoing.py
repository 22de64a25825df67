"""Taking back a :class:`kvedit.Memory`'s last changes: :meth:`~MemoryUndoMethods.undo`.

A memory holds what it is in one immutable snapshot (:class:`~kvedit.memory.held.Held`,
replaced whole by every change); each change keeps the snapshot it replaced, with the
memory's ``last_focus`` and ``last_answer`` then, on a stack of at most :data:`UNDO_STEPS`.
Undoing puts the last one back: nothing is recomputed.
"""

from __future__ import annotations

from ..errors import InvalidInputError

__all__ = ["UNDO_STEPS", "MemoryUndoMethods"]

UNDO_STEPS = 4
"""How many changes (an :meth:`~kvedit.Memory.add` or a remembered
:meth:`~kvedit.Memory.ask`) :meth:`~kvedit.Memory.undo` can take back, the last first. Each is
the memory's snapshot before it, with its own copy of the cache (about ``nbytes`` each), so
the stack is kept short."""


class MemoryUndoMethods:
    """What :class:`kvedit.Memory` does to take changes back (it holds ``_held``,
    ``last_focus``, ``last_answer`` and ``_undo``, the stack)."""

    _undo: tuple = ()

    def _replace_held(self, held) -> None:
        """Make ``held`` the memory's snapshot (one assignment), keeping the one it replaces
        for :meth:`undo`."""
        before = (self._held, self.last_focus, self.last_answer)
        self._held = held
        self._undo = (*self._undo, before)[-UNDO_STEPS:]

    @property
    def undoable(self) -> int:
        """How many changes :meth:`undo` can take back now (at most :data:`UNDO_STEPS`)."""
        return len(self._undo)

    def undo(self) -> None:
        """Take back the last change: a remembered :meth:`ask` (its question and answer) or an
        :meth:`add`, exactly (the state and its digest, the messages, turns, forgetting
        rounds, ``last_focus`` and ``last_answer`` as they were before it; nothing is
        recomputed). Again: the change before, up to :data:`UNDO_STEPS` back. An ``ask``
        with ``remember=False`` changed nothing and is not a change. A loaded memory starts
        with nothing to undo (what was done before its file was saved is not undoable); a
        :meth:`save` changes nothing, so a change before it can be undone after it (the file
        is then behind the memory until it is saved again).

        Raises:
            InvalidInputError: nothing to undo (no change since the memory was made or
                loaded, or the last :data:`UNDO_STEPS` taken back already).
        """
        if not self._undo:
            raise InvalidInputError(
                "nothing to undo: no message added or question remembered since this memory "
                f"was made or loaded, or the last {UNDO_STEPS} changes (the most kept) were "
                "taken back already"
            )
        (held, focus, answer), self._undo = self._undo[-1], self._undo[:-1]
        self._held, self.last_focus, self.last_answer = held, focus, answer
