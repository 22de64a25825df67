"""How long a context or a call may be: the positions a model attends to
(:func:`positions_limit`, overridden by a caller's ``max_positions``) and the tokens one call may
add to a state whatever the model (:data:`MAX_TOKENS_PER_CALL`), each refused before any work
(:func:`context_fits`, :func:`call_size`), by its characters before it is tokenized where they
decide it (:data:`MAX_CHARS_PER_TOKEN`). Import them from :mod:`kvedit.checks`.
"""

from __future__ import annotations

import numbers

from ..errors import InvalidInputError
from .values import count

MAX_TOKENS_PER_CALL = 131_072
"""The most tokens one call may add to a state: the text it runs (a capture, an extension, a
continuation) plus the tokens it decodes after it. This bounds memory apart from the model's
positions (:func:`positions_limit`), for a model whose config states no maximum or a huge one:
one call holds the activations of every token it runs and the cache entries it makes, and past
128K tokens that exhausts the accelerator's memory (or the host's) instead of failing cleanly,
so such a call is refused before tokenizing when its characters decide it (see
:data:`MAX_CHARS_PER_TOKEN`), else before the forward pass. The bundled models attend to at most
32,768 positions (Gemma-3; SmolLM2 8,192), so nothing they can do is refused; a longer context
is read in several calls (``capture`` a first part, then ``extend`` by the rest)."""

MAX_CHARS_PER_TOKEN = 1024
"""A generous upper bound on the characters one token covers, for the cheap early refusal of
:func:`context_fits`: a text of more than ``limit * MAX_CHARS_PER_TOKEN`` characters cannot
tokenize to ``limit`` tokens or fewer, so it is refused before any tokenizer work. (Tokens of
the vocabularies kvedit runs cover a few dozen characters at most; texts under the bound are
tokenized and their tokens counted.)"""

__all__ = [
    "MAX_CHARS_PER_TOKEN",
    "MAX_TOKENS_PER_CALL",
    "call_size",
    "context_fits",
    "positions_hint",
    "positions_limit",
]


def positions_limit(model, max_positions: int | None = None) -> int | None:
    """The most positions ``model`` attends to: ``max_positions`` when given (the caller's
    override, for a model whose config understates its context), else
    ``max_position_embeddings`` of the model's text config; None when neither is known (then
    only :data:`MAX_TOKENS_PER_CALL` bounds a call)."""
    if max_positions is not None:
        return count("max_positions", max_positions, minimum=1)
    config = getattr(model, "config", None)
    if config is None:
        return None
    get_text = getattr(config, "get_text_config", None)
    cfg = get_text() if callable(get_text) else config
    value = getattr(cfg, "max_position_embeddings", None)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        return None
    return int(value)


def positions_hint(keyword: str | None = "max_positions") -> str:
    """How to raise the position limit, for a refusal's message: the caller's own override
    keyword (``keyword``, when its function takes one) and the CLI's ``--max-positions``."""
    overrides = [f"pass {keyword}="] if keyword else []
    overrides.append("give the CLI --max-positions")
    return f" (a model whose config understates its context: {' or '.join(overrides)})"


def call_size(
    *, n_tokens: int | None = None, n_chars: int | None = None, reserve: int = 0, what: str
) -> None:
    """Refuse a call that would add more than :data:`MAX_TOKENS_PER_CALL` tokens to a state:
    ``n_tokens`` (the text it runs) plus ``reserve`` (the tokens it decodes after), or a text of
    ``n_chars`` characters longer than :data:`MAX_CHARS_PER_TOKEN` characters a token can make
    fit (refused before tokenizing). Applies whatever the model's positions, so a model whose
    config states no maximum is bounded too.

    Raises:
        InvalidInputError: naming the count, the reserve and the limit.
    """
    limit = MAX_TOKENS_PER_CALL
    room = max(limit - reserve, 0)
    follow = f" and {reserve} tokens to decode after it" if reserve else ""
    tail = (
        f"one call adds at most {limit} tokens to a state (kvedit.checks.MAX_TOKENS_PER_CALL, "
        "a memory bound); read a longer text in several calls (capture a part, extend by the rest)"
    )
    if n_chars is not None and n_chars > room * MAX_CHARS_PER_TOKEN:
        raise InvalidInputError(
            f"the {what} is {n_chars} characters long{follow}, more than {room} tokens can hold "
            f"(at most {MAX_CHARS_PER_TOKEN} characters a token): {tail}"
        )
    if n_tokens is not None and n_tokens + reserve > limit:
        raise InvalidInputError(
            f"the {what} is {n_tokens} tokens long{follow}, {n_tokens + reserve} tokens in all: "
            f"{tail}"
        )


def context_fits(
    model,
    *,
    n_tokens: int | None = None,
    n_chars: int | None = None,
    reserve: int = 0,
    max_positions: int | None = None,
    what: str = "context",
    keyword: str | None = "max_positions",
) -> None:
    """Refuse a context ``model`` cannot attend to: more tokens than its maximum positions
    (:func:`positions_limit`, ``max_positions`` overriding the model's config) minus
    ``reserve``, the room of what follows the context (a question's tokens plus
    ``max_new_tokens``); and, whatever the positions, a context and reserve past
    :data:`MAX_TOKENS_PER_CALL` (:func:`call_size`).

    Give ``n_tokens`` (the context's token count) or ``n_chars`` (its length in characters,
    before tokenizing). ``n_chars`` refuses only a text that certainly cannot fit: more than
    ``room * MAX_CHARS_PER_TOKEN`` characters (:data:`MAX_CHARS_PER_TOKEN`); a shorter text must
    be tokenized and checked again with ``n_tokens``. A model whose config states no maximum
    (and no ``max_positions``) is bounded by :data:`MAX_TOKENS_PER_CALL` alone.

    ``keyword`` names the caller's own override argument (``"max_positions"``, the default:
    every kvedit entry point that takes a text takes it); the message offers it only when
    given, so it never tells a caller to pass a keyword its function does not take.

    Raises:
        InvalidInputError: the context does not fit. The message names both numbers and the
            overrides (the caller's ``keyword``, the CLI's ``--max-positions``).
    """
    limit = positions_limit(model, max_positions)
    reserve = count("reserve", reserve)
    if n_tokens is not None:
        n_tokens = count("n_tokens", n_tokens)
    if limit is not None:
        room = limit - reserve
        if reserve:
            budget = (
                f"the model attends to {limit} positions, {reserve} of them kept for what follows "
                f"(the question and the answer), leaving {max(room, 0)}"
            )
        else:
            budget = f"the model attends to at most {limit} positions"
        hint = positions_hint(keyword)
        if room <= 0:
            raise InvalidInputError(f"no room for a {what}: {budget}{hint}")
        if n_tokens is not None and n_tokens > room:
            raise InvalidInputError(
                f"the {what} is {n_tokens} tokens long and does not fit: {budget}{hint}"
            )
        if n_chars is not None and n_chars > room * MAX_CHARS_PER_TOKEN:
            raise InvalidInputError(
                f"the {what} is {n_chars} characters long, more than {room} tokens can hold "
                f"(at most {MAX_CHARS_PER_TOKEN} characters a token): {budget}{hint}"
            )
    call_size(n_tokens=n_tokens, n_chars=n_chars, reserve=reserve, what=what)
