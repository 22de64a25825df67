"""Validators of argument values: numbers, counts, shares and strengths, flags, texts, layer
indices, callables' signatures, paths and storage dtypes, with the caps on a bias strength, a key
scale and the copies of a duplication.

Each validator returns the value in canonical form (a ``float``, an ``int``, a tuple of layer
indices...) or raises a :class:`~kvedit.errors.KVEditError` that names the argument and says what
was expected. A value of the wrong type raises :class:`~kvedit.errors.InvalidTypeError` (both a
``TypeError`` and a ``ValueError``); a value of the right type outside its range raises
:class:`~kvedit.errors.InvalidInputError` (a ``ValueError``). Import them from
:mod:`kvedit.checks`.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import torch

from ..atomic import check_path
from ..errors import EmptySelectionError, InvalidInputError, InvalidTypeError

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

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = [
    "MAX_DUPLICATE_COPIES",
    "MAX_SCALE_FACTOR",
    "MAX_STRENGTH",
    "call_refusal",
    "count",
    "describe",
    "flag",
    "layers",
    "path",
    "real",
    "save_dtype",
    "share",
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
