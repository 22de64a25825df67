"""A :class:`kvedit.Memory` in a file: one sealed state file (:mod:`kvedit.states.files`) whose
header carries the conversation as its ``attachment``: the prompt format, the messages, their
:class:`~kvedit.memory.records.Turn` records, the forgetting rounds and the ``Memory`` keywords
of its budget and quantizing (``budget``: ``max_tokens``, ``forget``, ``recent``, ``protect``,
``quantize``; a file written before they were kept has none). The seal covers it, and the
loader renders the messages again and refuses a file whose messages do not give its ids."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from ..errors import CorruptCacheError
from ..states.files.read import load_attached
from ..states.state import KVState
from .forgetting import Budget, Round
from .records import Turn
from .rendering import Message, Rendering, renderer_for

__all__ = ["ATTACHMENT_KIND", "MemoryFile", "budget_keywords", "memory_attachment", "read_memory"]

ATTACHMENT_KIND = "kvedit.memory"
"""What a memory file's header attachment says it is."""

KEYWORDS = {"max_tokens", "forget", "recent", "protect", "quantize"}
"""The ``Memory`` keywords a memory file keeps (:func:`budget_keywords`)."""


@dataclasses.dataclass(frozen=True)
class MemoryFile:
    """What a memory file holds: the ``state``, the ``prompt`` format, the ``messages``, their
    ``turns``, the forgetting ``rounds``, the messages' ``rendering`` (its ids are the
    state's), and the ``Memory`` ``keywords`` of its budget (empty for a file that has none)."""

    state: KVState
    prompt: str
    messages: list[Message]
    turns: list[Turn]
    rounds: list[Round]
    rendering: Rendering
    keywords: dict


def budget_keywords(budget: Budget | None, recent: int, quantize: int | None) -> dict:
    """The ``Memory`` keywords that give a memory ``budget``, ``recent`` and ``quantize``
    again (JSON-ready: a ``protect`` span as ``{"text"}``, ``{"pattern", "flags"}`` or
    ``{"chars"}``)."""
    keywords: dict = {"max_tokens": None, "recent": recent, "quantize": quantize}
    if budget is not None:
        keywords["max_tokens"] = budget.max_entries
        keywords["forget"] = budget.policy
        keywords["protect"] = [_span_json(span) for span in budget.protect]
    return keywords


def _span_json(span) -> dict:
    if isinstance(span, str):
        return {"text": span}
    if isinstance(span, re.Pattern):
        return {"pattern": span.pattern, "flags": span.flags}
    start, end = span
    return {"chars": [int(start), int(end)]}


def _span(item: dict):
    """A span written by :func:`_span_json`."""
    if set(item) == {"text"}:
        return str(item["text"])
    if set(item) == {"pattern", "flags"}:
        return re.compile(str(item["pattern"]), int(item["flags"]))
    if set(item) == {"chars"} and len(item["chars"]) == 2:
        return int(item["chars"][0]), int(item["chars"][1])
    raise ValueError(f"not a span: {item!r}")


def _keywords(stored) -> dict:
    """The budget keywords of a file's header (:func:`budget_keywords`), their types checked."""
    if stored is None:
        return {}
    if not isinstance(stored, dict) or not set(stored) <= KEYWORDS:
        raise ValueError(f"budget {stored!r}")
    out = dict(stored)
    for key in ("max_tokens", "recent", "quantize"):
        if out.get(key) is not None and not isinstance(out[key], int):
            raise ValueError(f"budget {key} {out[key]!r}")
    if "forget" in out and not isinstance(out["forget"], str):
        raise ValueError(f"budget forget {out['forget']!r}")
    if "protect" in out:
        out["protect"] = [_span(item) for item in out["protect"]]
    return out


def memory_attachment(
    prompt: str,
    messages: Sequence[Message],
    turns: Sequence[Turn],
    rounds: Sequence[Round],
    keywords: dict | None = None,
) -> dict:
    """The header attachment of a memory file (JSON-ready); ``keywords``: the
    :func:`budget_keywords` to keep (None: none)."""
    return {
        "kind": ATTACHMENT_KIND,
        "version": 1,
        "prompt": prompt,
        "messages": [m.as_dict() for m in messages],
        "turns": [t.to_json() for t in turns],
        "rounds": [dataclasses.asdict(r) for r in rounds],
        "budget": keywords,
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
        keywords = _keywords(attachment.get("budget"))
        rendering = renderer_for(prompt, tokenizer).render(messages)
    except (KeyError, TypeError, ValueError, re.error) as e:
        raise CorruptCacheError(f"{path}: the memory's header is malformed ({e})") from None
    if rendering.ids != state.token_ids.tolist() or len(turns) != len(messages):
        raise CorruptCacheError(
            f"{path}: the memory's {len(messages)} messages do not render to its "
            f"{len(state)} tokens"
        )
    return MemoryFile(state, prompt, messages, turns, rounds, rendering, keywords)
