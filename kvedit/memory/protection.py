"""The system messages a :class:`kvedit.Memory` under a budget never forgets, as token ranges of
its transcript: :func:`protected_ranges`.

The budget's rule (docs/memory.md): the first tokens, the system message, the last
``recent_tokens`` tokens and the ``protect`` spans are never forgotten (all but the system
message the :class:`~kvedit.memory.budget.Budget` finds itself). A system message is protected
by its own turn's tokens and by the tokens of its text
wherever the template writes it (:func:`system_text_ranges`): Gemma-3's official template folds
the system message into the first user turn, leaving the system turn one token (the BOS), so
its turn alone would protect nothing of it. A template that does not write a system message's
text verbatim once another message follows cannot have it protected: under a budget it is a
:class:`~kvedit.errors.TemplateError` (:func:`check_system_held`), before any work.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import TemplateError
from ..spans import tokens_in_ranges
from .budget import Budget
from .records import Turn
from .rendering import Message, Rendering

__all__ = ["check_system_held", "protected_ranges", "system_text_ranges", "system_texts"]


def system_texts(messages: Sequence[Message], rendering: Rendering) -> dict[int, tuple[int, int]]:
    """``{message index: token range [start, end)}`` of each system message's text in
    ``rendering`` (the rendering of ``messages``), wherever the template writes it (none for
    a text it does not write verbatim)."""
    out = {}
    for i, m in enumerate(messages):
        r = rendering.contents[i] if m.role == "system" and i < len(rendering.contents) else None
        tokens = tokens_in_ranges(rendering.offsets, [r]) if r else []
        if len(tokens):
            out[i] = (int(tokens[0]), int(tokens[-1]) + 1)
    return out


def system_text_ranges(messages: Sequence[Message], rendering: Rendering) -> list[tuple[int, int]]:
    """The token ranges of :func:`system_texts`."""
    return list(system_texts(messages, rendering).values())


def protected_ranges(
    turns: Sequence[Turn], messages: Sequence[Message], rendering: Rendering
) -> list[tuple[int, int]]:
    """The token ranges of the system messages (their turns and their texts), which a
    forgetting round keeps."""
    ranges = [(t.start, t.end) for t in turns if t.role == "system"]
    return ranges + system_text_ranges(messages, rendering)


def check_system_held(
    budget: Budget | None, prompt: str, messages: Sequence[Message], rendering: Rendering
) -> None:
    """Under a ``budget``, refuse a rendering (of ``messages`` and one more) in which a system
    message's text is not written verbatim though another message follows it.

    Raises:
        TemplateError: naming the prompt format and why.
    """
    if budget is None:
        return
    for i, r in enumerate(rendering.contents[: len(messages)]):
        if r is None and messages[i].role == "system" and len(rendering.contents) > i + 1:
            raise TemplateError(
                f"the {prompt!r} prompt format does not write the system message verbatim once "
                "other messages follow, so a budget (max_tokens/max_bytes) cannot protect it "
                "from forgetting as it protects every system message; use prompt='plain', or "
                "no budget; the memory is unchanged"
            )
