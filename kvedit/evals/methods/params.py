"""Method parameters: typed dataclasses, checked in ``__post_init__``, parsed from spec text.

Every method has a frozen dataclass of parameters (:attr:`Method.Params
<kvedit.evals.methods.registry.Method.Params>`), each field with a type and a default. A spec
such as ``auto:target=0.3:layers=(0.25,0.75)`` gives some of them as text; :func:`from_text`
converts each text by its field's type (:func:`parse_value`) and builds the dataclass, whose
``__post_init__`` checks the values and raises :class:`~kvedit.errors.InvalidInputError`.

Values are kept as written where the type allows: a ``float`` field given ``3`` holds the int
``3`` (an int is a valid float, PEP 484), so ``results.json`` records ``"strength": 3`` for
``auto:strength=3``, as it always has.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvedit import checks
from kvedit.errors import InvalidInputError, InvalidTypeError

__all__ = [
    "NoParams",
    "check_choice",
    "check_count",
    "check_fraction",
    "check_int_choice",
    "check_real",
    "from_text",
    "parse_value",
    "to_dict",
]


@dataclass(frozen=True)
class NoParams:
    """The parameters of a method that takes none."""


def to_dict(params: object) -> dict[str, Any]:
    """The parameters as a plain dict, fields in declaration order (what ``results.json``
    records under ``extra.params``)."""
    return dataclasses.asdict(params)


# -- checks used by the parameter dataclasses ---------------------------------------------------


def check_real(name: str, value: object, *, cap: float | None = None) -> int | float:
    """``value`` as a finite real: a Python int stays an int, anything else becomes a float.

    Raises:
        InvalidInputError: not a finite real number (a bool, a str, NaN...), or beyond ``cap``.
    """
    number = checks.real(name, value, cap=cap)
    return value if type(value) is int else number


def check_fraction(
    name: str, value: object, *, low: float = 0.0, high: float = 1.0, open_low: bool = False
) -> int | float:
    """A real in ``[low, high]`` (``(low, high]`` with ``open_low``), as :func:`check_real`."""
    number = check_real(name, value)
    if number > high or number < low or (open_low and number == low):
        bracket = "(" if open_low else "["
        raise InvalidInputError(f"{name} must be in {bracket}{low:g}, {high:g}], not {value!r}")
    return number


def check_count(name: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    """A whole number in ``[minimum, maximum]`` (an int, never a float or a bool)."""
    return checks.count(name, value, minimum=minimum, maximum=maximum)


def check_int_choice(name: str, value: object, choices: tuple[int, ...]) -> int:
    """A whole number (:func:`check_count`) that is one of ``choices``."""
    number = check_count(name, value)
    if number not in choices:
        raise InvalidInputError(f"{name} must be one of {choices}, not {number}")
    return number


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of the strings ``choices``."""
    if value not in choices or not isinstance(value, str):
        raise InvalidInputError(f"{name} must be one of {choices}, not {value!r}")
    return value


# -- spec text -> typed values --------------------------------------------------------------------

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0"}
_QUOTED = re.compile(r"""^(['"])(.*)\1$""", re.DOTALL)
_FLOAT_WORDS = ("nan", "inf", "infinity")  # float() accepts them; a spec never means them


def _text(text: str) -> str:
    """A string value: the text itself, or the contents of a quoted text (``'\\n'``), whose
    backslash escapes ``\\n``, ``\\t``, ``\\r``, ``\\0`` and ``\\<char>`` are decoded."""
    quoted = _QUOTED.match(text)
    if quoted is None:
        return text
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[1]), quoted[2], flags=re.DOTALL)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(f"expected an integer, got {text!r}") from None


def _real(text: str) -> int | float:
    """An integer text as an int (as written), any other number as a float."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise InvalidInputError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or text.strip().lstrip("+-").lower() in _FLOAT_WORDS:
        raise InvalidInputError(f"expected a finite number, got {text!r}")
    return value


def _boolean(text: str) -> bool:
    if text not in ("True", "False"):
        raise InvalidInputError(f"expected True or False, got {text!r}")
    return text == "True"


def _sequence(text: str, items: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(a,b)`` or ``[a,b]`` (brackets optional) as a tuple, each item parsed by its type;
    ``items`` is the tuple's type arguments (``(float, float)`` or ``(float, ...)``)."""
    inner = text.strip()
    if inner[:1] + inner[-1:] in ("()", "[]"):
        inner = inner[1:-1]
    parts = [p.strip() for p in inner.split(",")] if inner.strip() else []
    if parts and not parts[-1]:
        parts.pop()  # "(1,)"
    if len(items) == 2 and items[1] is Ellipsis:
        types_ = [items[0]] * len(parts)
    else:
        types_ = list(items)
        if len(parts) != len(types_):
            raise InvalidInputError(f"expected {len(types_)} comma-separated values, got {text!r}")
    return tuple(parse_value(p, t) for p, t in zip(parts, types_))


def parse_value(text: str, hint: Any) -> Any:
    """The spec text of one parameter as a value of the type ``hint``.

    ``int``: an integer (``7``); ``float``: a number (``1.5``, ``1e-3``; ``3`` stays the int
    ``3``); ``str``: the text itself, or a quoted text with backslash escapes (``'\\n'``);
    ``bool``: ``True``/``False``; ``X | None``: ``None``, or an ``X``; ``tuple[...]``: a
    parenthesized, comma-separated list (``(0.25,0.75)``).

    Raises:
        InvalidInputError: the text is not a value of that type.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text == "None":
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return parse_value(text, option)
            except InvalidInputError as error:
                errors.append(str(error))
        raise InvalidInputError("; ".join(errors) + (" (or None)" if type(None) in args else ""))
    if origin is tuple:
        return _sequence(text, args)
    if hint is bool:
        return _boolean(text)
    if hint is int:
        return _integer(text)
    if hint is float:
        return _real(text)
    if hint is str:
        return _text(text)
    raise InvalidTypeError(f"parameters of type {hint!r} cannot be given in a spec")


def from_text(params_type: type, texts: Mapping[str, str], method: str) -> Any:
    """``params_type(**values)``: each text of ``texts`` (field name -> spec text) parsed by
    its field's type, the other fields left at their defaults.

    Raises:
        InvalidInputError: an unknown field name, a text that is not of its field's type, or
            a value the dataclass refuses.
    """
    fields = {f.name: f for f in dataclasses.fields(params_type) if f.init}
    unknown = sorted(set(texts) - set(fields))
    if unknown:
        raise InvalidInputError(
            f"method {method!r}: unknown parameter(s) {unknown}; known: {sorted(fields) or 'none'}"
        )
    hints = typing.get_type_hints(params_type)
    values = {}
    for key, text in texts.items():
        try:
            values[key] = parse_value(text, hints[key])
        except InvalidInputError as error:
            raise InvalidInputError(f"method {method!r}: parameter {key!r}: {error}") from None
    try:
        return params_type(**values)
    except InvalidInputError as error:
        raise InvalidInputError(f"method {method!r}: {error}") from None
