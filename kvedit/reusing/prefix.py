"""Prefix reuse: continue from the longest stored prefix of a prompt and prefill only the rest.

``reuse(model, tokenizer, text, store)`` tokenizes ``text`` once (with the tokenizer's default
special tokens, as :func:`~kvedit.capture` does), asks the store for the longest stored prefix of
those token ids, and runs only the remaining ids on top of it. The remaining tokens are exactly
the full text's tokens after the prefix: they are never re-tokenized from a substring, so a
token that straddles the prefix boundary cannot change the result. The outcome is the state
``capture(model, tokenizer, text)`` would give, up to floating-point summation order, and its
history says so (a capture): the store serves plain captures only, and reuse only ever extends
one.

The state builders it uses (:func:`~kvedit.states.capturing.extend_ids` and the rest) are in
:mod:`kvedit.states.capturing`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from .. import checks
from ..errors import InvalidInputError, InvalidTypeError, StateAlteredError
from ..states.capturing import capture, encode, extend_ids
from ..states.state import KVState

if TYPE_CHECKING:
    from ..store import KVStore

__all__ = ["ReuseReport", "require_plain", "reuse"]


def require_plain(state: KVState, store: KVStore, what: str) -> None:
    """Raise :class:`~kvedit.errors.StateAlteredError` unless ``state`` (a state ``store``
    handed back) is a plain capture ``store`` may serve: reuse and blending only ever extend
    plain captures (the store refuses anything else; this guards that promise)."""
    problem = store.refusal(state)
    if problem is not None:
        raise StateAlteredError(
            f"{what}: the store handed back a state that is not a plain capture: {problem}"
        )


@dataclass
class ReuseReport:
    """What :func:`reuse` did.

    Attributes:
        tokens_reused: prompt tokens whose cache came from the store.
        tokens_computed: prompt tokens run through the model.
        seconds: wall time of the call, storing included.
        source: ``"memory"``, ``"disk"`` or None (nothing reused).
        key: store key of the returned state, when it is stored (None otherwise).
    """

    tokens_reused: int
    tokens_computed: int
    seconds: float
    source: str | None = None
    key: str | None = None

    @property
    def tokens(self) -> int:
        return self.tokens_reused + self.tokens_computed


def reuse(
    model: PreTrainedModel,
    tokenizer,
    text: str,
    store: KVStore,
    save: bool = True,
    ttl: float | None = None,
    *,
    max_positions: int | None = None,
) -> tuple[KVState, ReuseReport]:
    """The state of ``text``, reusing the longest prefix of it that ``store`` holds.

    Args:
        model, tokenizer: the model to run (and whose fingerprints select stored entries).
        text: the whole prompt, tokenized with the tokenizer's default special tokens.
        store: a :class:`~kvedit.KVStore`.
        save: store the resulting state (when any token was computed), so later prompts can
            reuse it in turn.
        ttl: seconds the stored result lives (see :meth:`KVStore.put`).
        max_positions: the most positions the model attends to (None: its config's
            ``max_position_embeddings``); the state keeps it (:attr:`KVState.max_positions`),
            whatever the stored entry it came from was made with.

    Returns:
        ``(state, report)``; the state is what ``capture(model, tokenizer, text)`` returns.

    Raises:
        InvalidTypeError: ``text`` is not a str, or ``store`` not a KVStore.
        InvalidInputError: ``text`` is empty (or tokenizes to nothing), or longer than the
            model's positions.
    """
    t0 = time.perf_counter()
    text = checks.text("text", text, allow_empty=False)
    if not callable(getattr(store, "longest_prefix_ids", None)):
        raise InvalidTypeError(f"store must be a kvedit.KVStore, not {checks.describe(store)}")
    checks.context_fits(model, n_chars=len(text), max_positions=max_positions)
    ids, offsets = encode(tokenizer, text)
    if not ids:
        raise InvalidInputError("reuse: the text tokenizes to nothing")
    checks.context_fits(model, n_tokens=len(ids), max_positions=max_positions)
    match = store.longest_prefix_ids(model, tokenizer, ids, offsets, text)
    n = match.n_tokens
    if match.state is not None:
        require_plain(match.state, store, "reuse")
    if match.state is None:
        state = capture(model, tokenizer, text, max_positions=max_positions)
    else:  # the caller's limit, not the one the stored state was made with
        found = match.state.replace(max_positions=max_positions)
        if n < len(ids):
            state = extend_ids(found, ids[n:], offsets[n:], text)
        else:
            state = found.replace(text=text)
    key = match.key if n == len(ids) else None
    if save and n < len(ids):
        key = store.put(state.replace(max_positions=None), ttl=ttl)  # the call's limit stays
    report = ReuseReport(
        tokens_reused=n,
        tokens_computed=len(ids) - n,
        seconds=time.perf_counter() - t0,
        source=match.source,
        key=key,
    )
    return state, report
