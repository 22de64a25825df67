"""The other edit :func:`kvedit.focusing.choice.focus` may apply (``focus(edit=...)``): refused
before any work unless callable as ``edit(state, spans)``, and its result refused unless it is an
edit of the focused state (same model, tokenizer and tokens; the state not written in place)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import checks
from ..errors import InvalidInputError, InvalidTypeError
from ..states.state import KVState
from .passages import Range

__all__ = ["check_edit", "checked_edit"]


def check_edit(edit: object) -> None:
    """Refuse an ``edit`` that is not a function callable as ``edit(state, spans)``."""
    if edit is None:
        return
    refusal = checks.call_refusal(edit, 2) if callable(edit) else "not callable"
    if refusal is not None:
        raise InvalidTypeError(
            f"edit must be a function (state, spans) -> state, not {checks.describe(edit)}: "
            f"{refusal}"
        )


def checked_edit(edit: Callable, state: KVState, spans: list[Range]) -> KVState:
    """``edit(state, spans)``, refused unless it is a state of the same model, tokenizer and
    token ids as ``state``, and ``state`` was not written in place."""
    edited = edit(state, spans)
    name = getattr(edit, "__name__", repr(edit))
    if not isinstance(edited, KVState):
        raise InvalidTypeError(f"edit {name!r} returned {type(edited).__name__}, not a KVState")
    state.check_unaltered(f"focus with edit {name!r}")
    differs = [
        what
        for what, same in (
            ("model fingerprint", edited.model_fingerprint == state.model_fingerprint),
            ("tokenizer fingerprint", edited.tokenizer_fingerprint == state.tokenizer_fingerprint),
            ("token ids", torch.equal(edited.token_ids.cpu(), state.token_ids.cpu())),
        )
        if not same
    ]
    if differs:
        raise InvalidInputError(
            f"edit {name!r} returned a state that is not an edit of the one focused: it "
            f"differs in its {' and '.join(differs)} (an edit keeps the model, tokenizer and "
            "tokens)"
        )
    return edited
