"""JSON-lines files of examples: :func:`load_jsonl` reads them strictly, :func:`write_jsonl`
writes them atomically. Names ending in ``.gz`` are gzipped.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from pathlib import Path

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidExampleError
from kvedit.evals.schema import Example

__all__ = ["load_jsonl", "read_text", "write_jsonl"]


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of ``path``, gunzipped when its name ends in ``.gz``.

    Raises:
        InvalidExampleError: (a ``ValueError``) naming the file: it is missing, a directory,
            unreadable, not gzip data (for ``.gz``), or not UTF-8 text (with the line).
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidExampleError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InvalidExampleError(f"{path}: is a directory, not a file") from None
    except (gzip.BadGzipFile, EOFError) as error:
        raise InvalidExampleError(f"{path}: not a complete gzip file: {error}") from None
    except OSError as error:
        raise InvalidExampleError(f"{path}: cannot read it: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise InvalidExampleError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}); a JSON-lines file "
            "is UTF-8 text"
        ) from None


def load_jsonl(path: str | os.PathLike[str]) -> list[Example]:
    """Read examples from a JSON-lines file (gzipped when the name ends in ``.gz``).

    One example per line::

        {"id": str, "instruction": str, "documents": [str, ...], "separator": str,
         "question": str, "answers": [str, ...], "gold_index": int,
         "metric": "subspan_em" | "first_number"}

    ``metric`` may be left out (``"subspan_em"``); any other key is an error. ``gold_index``
    must index ``documents`` (or be ``-1`` when ``documents`` is empty). Blank lines are
    skipped. Ids must be unique.

    Raises:
        InvalidExampleError: (a ``ValueError``) naming the file, the line number and the
            problem: bad JSON, a missing or unknown key, a value of the wrong type, an
            out-of-range ``gold_index``, an unknown metric, a duplicate id, or no examples.
    """
    path = Path(path)
    examples: list[Example] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidExampleError(f"{path}:{number}: bad JSON: {error}") from None
        except RecursionError:
            raise InvalidExampleError(f"{path}:{number}: JSON nested too deeply") from None
        try:
            example = Example.from_dict(data)
        except InvalidExampleError as error:
            raise InvalidExampleError(f"{path}:{number}: {error}") from None
        if example.id in seen:
            raise InvalidExampleError(
                f"{path}:{number}: duplicate id {example.id!r} (first on line {seen[example.id]})"
            )
        seen[example.id] = number
        examples.append(example)
    if not examples:
        raise InvalidExampleError(f"{path}: no examples (the file is empty or only blank lines)")
    return examples


def write_jsonl(examples: Iterable[Example], path: str | os.PathLike[str]) -> Path:
    """Write ``examples`` to ``path`` in the format of :func:`load_jsonl`, atomically.

    The file is gzipped when its name ends in ``.gz``. Returns the path.
    """
    path = Path(path)
    text = "".join(json.dumps(example.to_dict(), ensure_ascii=False) + "\n" for example in examples)
    payload = gzip.compress(text.encode("utf-8"), mtime=0) if path.suffix == ".gz" else text
    return atomic_write(path, payload)
