"""What a :class:`kvedit.Memory` records of each message (:class:`Turn`: ``to_json`` and
``from_json``, as a memory file's ``turns`` hold it), and how many messages it holds at most
(:data:`MAX_MESSAGES`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

__all__ = ["MAX_MESSAGES", "SOURCES", "Turn"]

MAX_MESSAGES = 100_000
"""The most messages a memory holds: every turn renders the whole conversation, so a count far
past any context the bundled models read (8K-32K positions) only makes each turn slower."""

SOURCES = ("computed", "decoded", "loaded")
"""Where a message's entries came from: run through the model when it was added, kept from
decoding the answer (the end-of-turn tokens computed), or read from a memory file."""


@dataclass(frozen=True)
class Turn:
    """One message of a memory and what it cost.

    Attributes:
        index: the message's place in the conversation (0 first).
        role: ``system``, ``user``, ``assistant`` or ``tool``.
        content: the message's text.
        start, end: its tokens are ``state.token_ids[start:end]`` (the template's markup
            around it included; an answer's generation prompt belongs to the answer).
        source: one of :data:`SOURCES`.
        computed: tokens run through the model for it (0 when loaded).
        kept: tokens whose K/V were kept from decoding the answer (answers only).
        recomputed: of ``computed``, tokens that had already been computed once (see ``note``).
        note: why tokens were computed again (empty when none were).
        nbytes: bytes its entries hold in the global-attention layers (a sliding-window layer
            holds a fixed window, counted in :attr:`kvedit.Memory.nbytes` only).
    """

    index: int
    role: str
    content: str
    start: int
    end: int
    source: str
    computed: int
    kept: int = 0
    recomputed: int = 0
    note: str = ""
    nbytes: int = 0

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict:
        """The turn as a memory file's ``turns`` hold it (JSON-ready: its fields by name)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Turn:
        """The turn :meth:`to_json` wrote (not checked: a file's turns are checked first,
        :mod:`kvedit.memory.attached`)."""
        return cls(**data)

    def with_nbytes(self, nbytes: int) -> Turn:
        """The same turn holding ``nbytes``."""
        return replace(self, nbytes=nbytes)
