"""Validators for the arguments of kvedit's public functions.

Each validator returns the value in canonical form (a ``float``, an ``int``, a tuple of layer
indices...) or raises a :class:`~kvedit.errors.KVEditError` that names the argument and says what
was expected. A value of the wrong type raises :class:`~kvedit.errors.InvalidTypeError` (both a
``TypeError`` and a ``ValueError``); a value of the right type outside its range raises
:class:`~kvedit.errors.InvalidInputError` (a ``ValueError``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import torch

from . import state_fit
from .atomic import check_path
from .errors import (
    CacheMismatchError,
    EmptySelectionError,
    InvalidInputError,
    InvalidTypeError,
    KVEditError,
)

MAX_STRENGTH = 1e4
"""The largest ``|strength|`` (nats) an attention bias may have.

Why a cap at all: softmax already saturates long before it. A key biased by ``s`` nats has its
attention weight multiplied by ``e**s``; beyond about 104 nats the weight of every other key
underflows float32 (``e**-104`` is below float32's smallest subnormal, ``1.4e-45``), so any
larger strength is the same hard mask. Larger values only do harm: ``1e39`` is ``inf`` in
float32 and turns the logits into NaN (``inf - inf``), and biases add up over several edits.
``1e4`` keeps a bias, a sum of many biases, and a logit plus a bias finite even in float16
(largest value 65504) and far below float32's limit (3.4e38), while allowing every strength
that can make a difference.
"""

MAX_SCALE_FACTOR = 1e4
"""The largest ``|factor|`` of :func:`kvedit.ops.scale_keys`, for the same reasons as
:data:`MAX_STRENGTH` (a key scaled by ``f`` scales its logits by ``f``)."""

MAX_DUPLICATE_COPIES = 64
"""The most extra copies :func:`kvedit.ops.duplicate` appends.

``copies`` extra copies add exactly ``log(copies + 1)`` nats; 64 copies give ``log 65 = 4.2``
nats, beyond the strengths that help (PASTA's α = 0.01 is 4.6 nats). Each copy grows every
global layer's cache by the span's length, so an unbounded count (``10**6``) would only exhaust
memory; a larger bias is one :func:`kvedit.ops.emphasize` call, at no memory cost.
"""

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

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = [
    "MAX_CHARS_PER_TOKEN",
    "MAX_DUPLICATE_COPIES",
    "MAX_SCALE_FACTOR",
    "MAX_STRENGTH",
    "MAX_TOKENS_PER_CALL",
    "context_fits",
    "call_refusal",
    "call_size",
    "count",
    "describe",
    "layers",
    "path",
    "positions_hint",
    "positions_limit",
    "save_dtype",
    "state_fits_model",
    "strength",
    "text",
]


def _is_bool(value) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return type(value).__name__ in ("bool_", "bool") and type(value).__module__ == "numpy"


def _scalar(value):
    """A 0-d torch tensor or numpy array as a Python number; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_complex():
            return value
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        kind = getattr(getattr(value, "dtype", None), "kind", "")
        if kind in "fiu":
            return value.item()
    return value


def describe(value) -> str:
    """``repr(value)`` (cut at 80 characters) and its type, for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (a {type(value).__name__})"


def flag(name: str, value) -> bool:
    """``value`` as a bool (a numpy bool or a 0-d bool tensor too); an
    :class:`InvalidTypeError` naming ``name`` for anything else (``1``, ``"yes"``)."""
    value = _scalar(value)  # a 0-d tensor or array becomes a Python value
    if isinstance(value, torch.Tensor) or not _is_bool(value):
        raise InvalidTypeError(f"{name} must be True or False, not {describe(value)}")
    return bool(value)


def real(name: str, value, *, cap: float | None = None) -> float:
    """``value`` as a finite float: a Python, numpy or 0-d torch int or float, not a bool.

    Raises :class:`InvalidTypeError` for other types, :class:`InvalidInputError` for NaN,
    infinities, values beyond float32 and, when given, values with ``|value| > cap``.
    """
    if _is_bool(value):
        raise InvalidTypeError(f"{name} must be a finite number (int or float), not {value!r}")
    plain = _scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, numbers.Real):
        raise InvalidTypeError(
            f"{name} must be a finite number (int or float), not {describe(value)}"
        )
    try:
        number = float(plain)
    except (OverflowError, ValueError) as e:
        raise InvalidInputError(f"{name} must be a finite number, not {value!r}: {e}") from e
    if not math.isfinite(number):
        raise InvalidInputError(f"{name} must be a finite number, not {number!r}")
    if abs(number) > _FLOAT32_MAX:
        raise InvalidInputError(
            f"{name} = {number!r} is not finite in float32 (largest {_FLOAT32_MAX:.3g})"
        )
    if cap is not None and abs(number) > cap:
        raise InvalidInputError(f"|{name}| must be at most {cap:g}, not {number!r}")
    return number


def share(name: str, value) -> float:
    """A share in ``[0, 1]``, as a float (:func:`real`, then the range:
    :class:`InvalidInputError` outside it)."""
    number = real(name, value)
    if not 0.0 <= number <= 1.0:
        raise InvalidInputError(f"{name} must be a share in [0, 1], not {number!r}")
    return number


def strength(name: str, value) -> float:
    """A bias strength in nats, as a float.

    Accepts Python ints and floats and numpy or 0-d torch ints and floats. Refuses bools,
    NaN, infinities, and values whose magnitude exceeds :data:`MAX_STRENGTH` (1e4 nats: any
    strength above ~104 nats is already a hard mask in float32, and much larger ones overflow
    float32 to ``inf`` and make the logits NaN; see :data:`MAX_STRENGTH`).

    Raises:
        InvalidTypeError: not a number (a bool, a str, None, a tensor of several values).
        InvalidInputError: NaN, infinite, or ``|value| > MAX_STRENGTH``.
    """
    return real(name, value, cap=MAX_STRENGTH)


def count(name: str, value, *, minimum: int = 0, maximum: int | None = None) -> int:
    """A whole number in ``[minimum, maximum]``, as an int.

    Accepts Python ints and numpy or 0-d torch integers. Refuses bools and every float, even
    ``2.0`` (a count given as a float is most often a bug).

    Raises:
        InvalidTypeError: not an int (a bool, a float, a str, None).
        InvalidInputError: below ``minimum`` or above ``maximum``.
    """
    if _is_bool(value):
        raise InvalidTypeError(f"{name} must be an int, not {value!r}")
    plain = _scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, numbers.Integral):
        raise InvalidTypeError(f"{name} must be an int, not {describe(value)}")
    number = int(plain)
    if number < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, not {number}")
    if maximum is not None and number > maximum:
        raise InvalidInputError(f"{name} must be <= {maximum}, not {number}")
    return number


def call_refusal(fn: Callable, n_positional: int, keywords: Sequence[str] = ()) -> str | None:
    """Why ``fn`` cannot be called with ``n_positional`` arguments and ``keywords`` (by its
    signature: a keyword it lacks is named first), or ``None`` when it can or its signature
    cannot be read (a builtin's, say)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [k for k in keywords if k not in takes]
        if missing:
            return f"it takes no keyword {', '.join(f'{k}=' for k in missing)}"
    try:
        signature.bind(*[None] * n_positional, **dict.fromkeys(keywords))
    except TypeError as e:
        return str(e)
    return None


def text(name: str, value, *, allow_empty: bool = True) -> str:
    """A ``str``. Refuses None, bytes, lists of texts (kvedit handles one text per call) and
    every other type; refuses ``""`` when ``allow_empty`` is False.

    Raises:
        InvalidTypeError: not a str.
        InvalidInputError: empty while ``allow_empty`` is False.
    """
    if not isinstance(value, str):
        if isinstance(value, (list, tuple)):
            raise InvalidTypeError(
                f"{name} must be one str, not a {type(value).__name__} of {len(value)} items "
                "(kvedit captures and continues one text per call)"
            )
        raise InvalidTypeError(f"{name} must be a str, not {describe(value)}")
    if not allow_empty and not value:
        raise InvalidInputError(f"{name} is empty: give a non-empty str")
    return value


def layers(value, n_layers: int, *, name: str = "layers") -> tuple[int, ...] | None:
    """Layer indices ``0 <= i < n_layers``, sorted and without repeats; None means all layers.

    Raises:
        InvalidTypeError: not None nor a sequence of ints (a bare int, a str, a dict, bools).
        EmptySelectionError: an empty sequence (it would edit nothing; None means all).
        InvalidInputError: an index out of range (negative indices are not accepted).
    """
    if value is None:
        return None
    array = isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"
    if array and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, set, range)):
        raise InvalidTypeError(
            f"{name} must be None (all layers) or a list of layer indices, not {describe(value)}"
        )
    chosen = [count(f"{name}[{i}]", item, minimum=-(2**63)) for i, item in enumerate(value)]
    if not chosen:
        raise EmptySelectionError(
            f"{name} is empty: nothing would be edited or steered (None means all layers)"
        )
    bad = sorted({i for i in chosen if not 0 <= i < n_layers})
    if bad:
        raise InvalidInputError(
            f"{name} {bad} out of range for a {n_layers}-layer model (valid: 0..{n_layers - 1})"
        )
    return tuple(sorted(set(chosen)))


def path(value, what: str = "path"):
    """A file path kvedit can write to (see :func:`kvedit.atomic.check_path`)."""
    return check_path(value, what)


def save_dtype(dtype) -> torch.dtype | None:
    """The dtype keys and values are stored in: None (as they are) or a float dtype.

    Integer and bool dtypes would truncate keys and values without a word, and the file would
    then answer differently; float8 overflows at a few hundred. Use :func:`kvedit.ops.quantize`
    for a compact cache.

    Raises:
        InvalidTypeError: not a ``torch.dtype``.
        InvalidInputError: not float16, bfloat16, float32 or float64.
    """
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(f"dtype must be a torch.dtype or None, not {describe(dtype)}")
    if dtype not in _STORAGE_DTYPES:
        names = ", ".join(str(d) for d in _STORAGE_DTYPES)
        raise InvalidInputError(
            f"keys and values can only be saved as {names}, not {dtype}: other dtypes would "
            "truncate them (use kvedit.ops.quantize for a compact cache)"
        )
    return dtype


# ------------------------------------------------------------------------ a state vs a model


def _model_layers(model):
    """The gate's per-layer facts (window, KV heads, key/value head sizes, from its probe)."""
    from .runtime import spec

    return spec(model).layers


def state_fits_model(
    state,
    model,
    tokenizer=None,
    *,
    fingerprints: bool = True,
    deep: bool = False,
    error: type[KVEditError] = CacheMismatchError,
) -> None:
    """Check that ``state`` can run on ``model``: made by it, and shaped as its cache is.

    Checks (shapes only, cheap): the model and tokenizer fingerprints (when ``fingerprints``;
    the tokenizer's only when ``tokenizer`` is given), one layer per decoder layer with the
    model's sliding windows, keys and values ``[batch, kv_heads, n, head_dim]`` with the model's
    KV heads and head size, ``token_index``/``positions`` of length ``n``, a bias
    ``[batch, 1 | kv_heads | heads, n]``, sliding layers holding at most ``window`` entries,
    and ``token_ids``/``offsets``/``position_ids``/``last_logits`` of matching sizes. With
    ``deep``, also the values: token ids inside the vocabulary, ``token_index`` in
    ``[-1, n_tokens)``, positions before ``next_position``, offsets inside the text.

    Raises:
        error: (default :class:`~kvedit.errors.CacheMismatchError`) with every problem found,
            up to five. :func:`kvedit.load_state` passes
            :class:`~kvedit.errors.CorruptCacheError`: a file whose fingerprint names the
            model but whose structure does not fit it has lying metadata.
    """
    problems: list[str] = []
    if fingerprints:
        state_fit.check_fingerprints(state, model, tokenizer)
    specs = _model_layers(model)
    heads = getattr(model.config.get_text_config(), "num_attention_heads", None)
    if len(state.layers) != len(specs):
        problems.append(f"{len(state.layers)} layers, the model has {len(specs)}")
    n_tokens = int(state.token_ids.shape[0]) if state.token_ids.ndim == 1 else -1
    for i, (layer, ls) in enumerate(zip(state.layers, specs, strict=False)):
        keys, values = tuple(layer.kv_shape), tuple(layer.value_shape)
        if len(keys) != 4 or len(values) != 4:
            problems.append(f"layer {i}: keys {keys} / values {values} are not 4-D")
            continue
        problems += state_fit.layer_problems(i, layer, ls, heads)
        if deep and keys[2] and n_tokens >= 0:
            problems += state_fit.layer_value_problems(i, layer, n_tokens, state.next_position)
        if len(problems) >= 5:
            break
    problems += state_fit.token_shape_problems(state, n_tokens)
    n_in, n_out = state_fit.vocab_sizes(model)
    if state.last_logits.ndim != 1 or (n_out is not None and state.last_logits.numel() != n_out):
        problems.append(
            f"last_logits {tuple(state.last_logits.shape)}, the model's vocabulary is {n_out}"
        )
    if deep and not problems and n_tokens > 0:
        problems += state_fit.token_value_problems(state, n_in)
    if problems:
        name = getattr(model, "name_or_path", None) or type(model).__name__
        raise error(f"the cache does not fit the model {name!r}: " + "; ".join(problems[:5]))


# ------------------------------------------------------------------------ context length


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
