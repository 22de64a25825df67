"""A :class:`kvedit.Memory` in a file: one sealed state file (:mod:`kvedit.states.files`) whose
header carries the conversation as its ``attachment``: the prompt format, the messages, their
:class:`~kvedit.memory.records.Turn` records and the forgetting rounds. The seal covers it, and
the loader renders the messages again and refuses a file whose messages do not give its ids."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from ..errors import CorruptCacheError
from ..states.files.read import load_attached
from ..states.state import KVState
from .forgetting import Round
from .records import Turn
from .rendering import Message, Rendering, renderer_for

__all__ = ["ATTACHMENT_KIND", "MemoryFile", "memory_attachment", "read_memory"]

ATTACHMENT_KIND = "kvedit.memory"
"""What a memory file's header attachment says it is."""


@dataclasses.dataclass(frozen=True)
class MemoryFile:
    """What a memory file holds: the ``state``, the ``prompt`` format, the ``messages``, their
    ``turns``, the forgetting ``rounds``, and the messages' ``rendering`` (its ids are the
    state's)."""

    state: KVState
    prompt: str
    messages: list[Message]
    turns: list[Turn]
    rounds: list[Round]
    rendering: Rendering


def memory_attachment(
    prompt: str, messages: Sequence[Message], turns: Sequence[Turn], rounds: Sequence[Round]
) -> dict:
    """The header attachment of a memory file (JSON-ready)."""
    return {
        "kind": ATTACHMENT_KIND,
        "version": 1,
        "prompt": prompt,
        "messages": [m.as_dict() for m in messages],
        "turns": [t.to_json() for t in turns],
        "rounds": [dataclasses.asdict(r) for r in rounds],
    }


def read_memory(
    path: str | os.PathLike, model, tokenizer, max_positions: int | None = None
) -> MemoryFile:
    """A memory file, checked: the messages rendered again give the state's ids exactly.

    Raises:
        CacheMismatchError: the file was made by another model or tokenizer.
        CorruptCacheError: not a memory file, damaged, or messages that do not render to its
            tokens.
    """
    state, attachment = load_attached(path, model, tokenizer, max_positions=max_positions)
    if not isinstance(attachment, dict) or attachment.get("kind") != ATTACHMENT_KIND:
        raise CorruptCacheError(f"{path}: a state file, not a memory (Memory.save writes one)")
    try:
        messages = [Message(m["role"], m["content"]) for m in attachment["messages"]]
        prompt = attachment["prompt"]
        turns = [Turn(**t) for t in attachment["turns"]]
        rounds = [Round(**r) for r in attachment.get("rounds", [])]
        rendering = renderer_for(prompt, tokenizer).render(messages)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCacheError(f"{path}: the memory's header is malformed ({e})") from None
    if rendering.ids != state.token_ids.tolist() or len(turns) != len(messages):
        raise CorruptCacheError(
            f"{path}: the memory's {len(messages)} messages do not render to its "
            f"{len(state)} tokens"
        )
    return MemoryFile(state, prompt, messages, turns, rounds, rendering)
