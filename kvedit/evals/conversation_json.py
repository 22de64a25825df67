"""JSON read with the place of every object and array, so that a conversation file's loader
(:mod:`kvedit.evals.conversation_files`) can name the line of an offending value.

:func:`read_located` reads a JSON document whose objects are :class:`Located` dicts and whose
arrays are :class:`LocatedList` lists, each knowing the offset of its opening bracket;
:func:`line_of` gives the line of a container, of one of its keys or of one of its items. A
duplicate key, ``NaN``/``Infinity`` and a document nested too deeply are refused, naming the
line.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from pathlib import Path

from kvedit.errors import InvalidExampleError

__all__ = ["Located", "LocatedList", "line_of", "read_located"]

_SPACE = " \t\r\n"


class Located(dict):
    """A JSON object read by :func:`read_located`: ``at`` is the offset of its ``{``."""

    at: int = 0


class LocatedList(list):
    """A JSON array read by :func:`read_located`: ``at`` is the offset of its ``[``."""

    at: int = 0


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Constant(Exception):
    pass


def _pairs(pairs: list[tuple[str, object]]) -> Located:
    out = Located()
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _constant(name: str) -> object:
    raise _Constant(name)


class _Decoder(json.JSONDecoder):
    """The pure-Python scanner, its objects and arrays given their offsets."""

    def __init__(self) -> None:
        super().__init__(object_pairs_hook=_pairs, parse_constant=_constant)

        def parse_object(s_and_end, *rest):
            try:
                obj, end = json.decoder.JSONObject(s_and_end, *rest)
            except _Duplicate as e:
                raise _DuplicateAt(e.key, s_and_end[1] - 1) from None
            obj.at = s_and_end[1] - 1
            return obj, end

        def parse_array(s_and_end, scan_once):
            values, end = json.decoder.JSONArray(s_and_end, scan_once)
            out = LocatedList(values)
            out.at = s_and_end[1] - 1
            return out, end

        self.parse_object = parse_object
        self.parse_array = parse_array
        self.scan_once = json.scanner.py_make_scanner(self)


class _DuplicateAt(Exception):
    def __init__(self, key: str, at: int) -> None:
        super().__init__(key)
        self.key, self.at = key, at


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _child_offset(text: str, start: int, child: str | int) -> int:
    """The offset of ``child`` (a key of the object opening at ``start``, or an index of the
    array opening there) in ``text``; ``start`` when it is not there."""
    depth, i, fresh, count = 0, start, False, 0
    while i < len(text):
        c = text[i]
        if depth == 1 and c not in _SPACE:
            if isinstance(child, int) and fresh:
                if count == child:
                    return i
                count += 1
            fresh = False
            if isinstance(child, str) and c == '"':
                key, end = json.decoder.scanstring(text, i + 1)
                j = end
                while j < len(text) and text[j] in _SPACE:
                    j += 1
                if key == child and text[j : j + 1] == ":":
                    return i
                i = end
                continue
        if c == '"':
            i = json.decoder.scanstring(text, i + 1)[1]
            continue
        if c in "[{":
            depth += 1
            fresh = depth == 1 or fresh
        elif c in "]}":
            depth -= 1
            if depth == 0:
                break
        elif c == "," and depth == 1:
            fresh = True
        i += 1
    return start


def line_of(text: str, node: object, child: str | int | None = None) -> int | None:
    """The line of ``child`` (a key or an index) of ``node`` in ``text``, or of ``node`` itself
    (None: ``node`` was not read by :func:`read_located`)."""
    at = getattr(node, "at", None)
    if at is None:
        return None
    return _line(text, at if child is None else _child_offset(text, at, child))


def _constant_offset(text: str) -> int:
    """The offset of the first ``NaN``/``Infinity`` outside a string."""
    i = 0
    while i < len(text):
        if text[i] == '"':
            i = json.decoder.scanstring(text, i + 1)[1]
            continue
        if text.startswith(("NaN", "Infinity"), i):
            return i
        i += 1
    return 0


def read_located(path: Path, text: str) -> object:
    """``text`` (the contents of ``path``) parsed, objects and arrays located.

    Raises:
        InvalidExampleError: naming ``path`` and the line: not JSON (the decoder's message), a
            key given twice in one object, ``NaN`` or ``Infinity`` (not JSON), nesting too deep.
    """
    try:
        value, end = _Decoder().raw_decode(text, json.decoder.WHITESPACE.match(text, 0).end())
    except json.JSONDecodeError as e:
        raise InvalidExampleError(
            f"{path}:{e.lineno}: not JSON: {e.msg} (column {e.colno})"
        ) from None
    except _DuplicateAt as e:
        line = _line(text, e.at)
        raise InvalidExampleError(
            f"{path}:{line}: the key {e.key!r} is given twice in one object"
        ) from None
    except _Constant as e:
        line = _line(text, _constant_offset(text))
        raise InvalidExampleError(f"{path}:{line}: {e} is not a JSON number") from None
    except RecursionError:
        raise InvalidExampleError(f"{path}: JSON nested too deeply") from None
    rest = json.decoder.WHITESPACE.match(text, end).end()
    if rest != len(text):
        raise InvalidExampleError(
            f"{path}:{_line(text, rest)}: not JSON: extra data after the document"
        )
    return value
