"""Whether what a call adds fits the positions a state has left (:func:`check_room`), and the
most characters of a text one token of a tokenizer can cover (:func:`chars_per_token`).

A state is typed :class:`~kvedit.states.view.StateView` here (:mod:`kvedit.states.state`
imports this module).

A text of more than ``room * chars_per_token(tokenizer)`` characters cannot tokenize to
``room`` tokens or fewer, so :meth:`kvedit.KVState.check_room` refuses it before the tokenizer
runs: a 2 MB message for SmolLM2's 8,192 positions is refused at once, not after seconds and
hundreds of MB of tokenizing (the generic bound,
:data:`kvedit.checks.MAX_CHARS_PER_TOKEN`, lets 8 MB through there).

The bound is the longest entry of the vocabulary, added tokens included: a byte-level entry's
length is its bytes, at least the characters it covers; a SentencePiece entry's is its
characters. It holds only where no step of the tokenizer lets one token cover characters its
entry does not show: the normalizer and the pre-tokenizer must be of kinds that never remove
characters (composing Unicode normalizers, NFC and NFKC, may fold up to :data:`COMPOSE`
characters into one: the bound is multiplied by it), the model a BPE that never fuses unknown
characters into one token, and no added token may swallow the spaces beside it (``lstrip``,
``rstrip``). Anything else (a slow tokenizer, WordPiece's whole unknown words, a normalizer
that strips accents or control characters, a pre-tokenizer that drops whitespace) gets
:data:`~kvedit.checks.MAX_CHARS_PER_TOKEN`.
"""

from __future__ import annotations

import json
import threading
import weakref

from .. import checks
from ..errors import InvalidInputError
from ..fingerprint import tokenizer_fingerprint
from .view import StateView

__all__ = ["COMPOSE", "chars_per_token", "check_room"]

COMPOSE = 4
"""The most characters a composing Unicode normalization (NFC, NFKC) folds into one: a base
and its combining marks, or a Hangul syllable's three jamo, with room to spare."""

_EXPANDING = {"Prepend", "Lowercase", "NFD", "NFKD"}  # normalizers that never remove characters
_COMPOSING = {"NFC", "NFKC"}
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _state(component) -> dict | None:
    """A normalizer's or pre-tokenizer's JSON description (None for none)."""
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _normalizer_factor(desc: dict | None) -> int | None:
    """How many characters one normalized character may stand for (None: no bound, a
    normalizer that may remove characters)."""
    if desc is None:
        return 1
    kind = desc.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in desc.get("normalizers", []):
            f = _normalizer_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _EXPANDING:
        return 1
    if kind in _COMPOSING:
        return COMPOSE
    if kind == "Replace":  # a literal replaced by at least as many characters
        pattern, content = desc.get("pattern", {}).get("String"), desc.get("content")
        if isinstance(pattern, str) and isinstance(content, str):
            return 1 if 0 < len(pattern) <= len(content) else None
    return None


def _keeps_characters(desc: dict | None) -> bool:
    """Whether a pre-tokenizer only splits (never drops characters)."""
    if desc is None:
        return True
    kind = desc.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(inner) for inner in desc.get("pretokenizers", []))
    behavior = str(desc.get("behavior", "")).lower()
    return kind in _SPLITTING and behavior != "removed"


def _bound(tokenizer) -> int:
    """:func:`chars_per_token`, computed."""
    default = checks.MAX_CHARS_PER_TOKEN
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return default
    try:
        factor = _normalizer_factor(_state(backend.normalizer))
        splits = _keeps_characters(_state(backend.pre_tokenizer))
        model = backend.model
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        vocab = tokenizer.get_vocab()
    except (AttributeError, TypeError, ValueError):
        return default
    if factor is None or not splits or type(model).__name__ != "BPE" or not vocab:
        return default
    if getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False):
        return default
    if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in added.values()):
        return default
    longest = max(len(entry) for entry in vocab)
    return max(1, min(default, longest * factor))


def chars_per_token(tokenizer) -> int:
    """The most characters of a text one token of ``tokenizer`` can cover (module docstring),
    at most :data:`kvedit.checks.MAX_CHARS_PER_TOKEN`. Memoised per tokenizer object (computed
    again when its vocabulary changes)."""
    try:
        stamp = tokenizer_fingerprint(tokenizer)
    except Exception:  # noqa: BLE001 - no fingerprint: no tokenizer this bound can read
        return checks.MAX_CHARS_PER_TOKEN
    with _LOCK:
        try:
            cached = _CACHE.get(tokenizer)
        except TypeError:  # not weak-referenceable
            return _bound(tokenizer)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    bound = _bound(tokenizer)
    with _LOCK:
        _CACHE[tokenizer] = (stamp, bound)
    return bound


def check_room(
    state: StateView, n_tokens: int, reserve: int = 0, *, what: str = "continuation", n_chars=None
) -> None:
    """:meth:`kvedit.KVState.check_room`: refuse ``n_tokens`` new tokens and ``reserve`` more
    after them past the model's positions (counted from the state's next position), a text of
    ``n_chars`` characters that more than :func:`chars_per_token` characters a token cannot
    fit in them (before it is tokenized), and a call past
    :data:`kvedit.checks.MAX_TOKENS_PER_CALL` (:func:`kvedit.checks.call_size`).

    Raises:
        InvalidInputError: naming the count, the limit and how to raise it.
    """
    n_tokens = checks.count("n_tokens", n_tokens)
    reserve = checks.count("reserve", reserve)
    limit = checks.positions_limit(state.model, state.max_positions)
    if limit is not None:
        per_token = checks.MAX_CHARS_PER_TOKEN
        if n_chars is not None and state.tokenizer is not None:
            per_token = chars_per_token(state.tokenizer)
        next_position = state.next_position
        room = limit - next_position - reserve
        head = (
            f"the model attends to at most {limit} positions; the state's next position is "
            f"{next_position}" + (f" and {reserve} tokens are to follow" if reserve else "")
        )
        hint = " (a model whose config understates its context: capture or load the state "
        hint += "with max_positions=, or give the CLI --max-positions)"
        if n_chars is not None and n_chars > max(room, 0) * per_token:
            raise InvalidInputError(
                f"the {what} is {n_chars} characters long, more than the {max(room, 0)} "
                f"positions left can hold (one token covers at most {per_token} characters "
                f"of this tokenizer's text): {head}{hint}"
            )
        if n_tokens > room:
            raise InvalidInputError(
                f"the {what} is {n_tokens} tokens long and would reach position "
                f"{next_position + n_tokens + reserve}: {head}{hint}"
            )
    checks.call_size(n_tokens=n_tokens, n_chars=n_chars, reserve=reserve, what=what)
