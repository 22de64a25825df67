"""JSON-lines files of examples: :func:`load_jsonl` reads them strictly, :func:`write_jsonl`
writes them atomically. Names ending in ``.gz`` are gzipped. The files of a run's results are
read strictly too: :func:`read_json` (``results.json``, ``partial.settings.json``) and
:func:`read_records` (``partial.jsonl``; :func:`read_numbered_records` with each record's
line), each error naming the file and the line. :class:`PartialRecords` writes a run's
``partial.jsonl`` as it goes, from its first records on.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidExampleError, InvalidInputError
from kvedit.evals.schema import Example

__all__ = [
    "PartialRecords",
    "check_record",
    "load_jsonl",
    "matching_records",
    "read_json",
    "read_numbered_records",
    "read_records",
    "read_text",
    "reused_records",
    "write_jsonl",
]


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
            example = Example.from_json(data)
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
    text = "".join(json.dumps(example.to_json(), ensure_ascii=False) + "\n" for example in examples)
    payload = gzip.compress(text.encode("utf-8"), mtime=0) if path.suffix == ".gz" else text
    return atomic_write(path, payload)


def read_json(path: str | os.PathLike[str], option: str) -> dict:
    """The JSON object in the file ``path`` (``option``, e.g. ``"--reuse"``, names it in errors).

    Raises:
        InvalidInputError: naming ``option``, the file and, for bad JSON, the line: the file is
            missing, unreadable, not UTF-8, empty, not JSON, or not a JSON object.
    """
    name = f"{option} {path}"
    try:
        text = read_text(path)
    except InvalidExampleError as error:
        raise InvalidInputError(f"{option} {error}") from None
    if not text.strip():
        raise InvalidInputError(f"{name}: the file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidInputError(
            f"{name}:{error.lineno}: bad JSON: {error.msg} (column {error.colno})"
        ) from None
    except RecursionError:
        raise InvalidInputError(f"{name}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidInputError(f"{name}: expected a JSON object, not a {type(data).__name__}")
    return data


def check_record(record: object, where: str) -> dict:
    """``record`` if it is a result record's dict with a string ``id`` and ``method``; else
    :class:`~kvedit.errors.InvalidInputError` naming ``where`` (the file and line or index)."""
    if not isinstance(record, dict):
        raise InvalidInputError(
            f"{where}: a result record must be a JSON object, not a {type(record).__name__}"
        )
    for key in ("id", "method"):
        if not isinstance(record.get(key), str):
            raise InvalidInputError(f"{where}: a result record needs a string {key!r}")
    return record


def read_records(path: str | os.PathLike[str], option: str) -> list[dict]:
    """The result records of a JSON-lines file such as ``partial.jsonl``, one per line
    (:func:`read_numbered_records` without the line numbers)."""
    return [record for _, record in read_numbered_records(path, option)]


def read_numbered_records(path: str | os.PathLike[str], option: str) -> list[tuple[int, dict]]:
    """``(line number, record)`` of each result record of a JSON-lines file such as
    ``partial.jsonl``, one per line.

    A run killed while writing leaves its last line cut: a last line that does not end in a
    newline and does not parse is dropped with a warning on stderr (its pair is recomputed).

    Raises:
        InvalidInputError: naming ``option``, the file and the line: any other line that is
            not JSON, or not a record (:func:`check_record`); an unreadable file.
    """
    name = f"{option} {path}"
    try:
        lines = read_text(path).split("\n")
    except InvalidExampleError as error:
        raise InvalidInputError(f"{option} {error}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as error:
            if number == len(lines):  # no newline after it: cut by a kill mid-write
                print(
                    f"warning: {name}:{number}: the last line is cut (the run was stopped "
                    "while writing it); dropped, its answer is computed again",
                    file=sys.stderr,
                )
                continue
            raise InvalidInputError(f"{name}:{number}: bad JSON: {error}") from None
        records.append((number, check_record(record, f"{name}:{number}")))
    return records


def matching_records(
    records: dict[tuple[str, str], dict],
    examples: Sequence[Example],
    origin: str,
    *,
    unchecked: bool = False,
) -> dict[tuple[str, str], dict]:
    """The ``(id, method) -> record`` pairs of ``records`` (from ``origin``, named in errors)
    that answer one of ``examples``: the same id and the same example digest
    (:meth:`~kvedit.evals.schema.Example.digest`). Records of ids this run does not ask are
    left out.

    Raises:
        InvalidInputError: a record of one of this run's ids answered another example (its
            digest differs: the earlier run had other ``n_docs``, ``trials``, ``limit`` or
            ``data``), or names no digest (a file from before records had one) and
            ``unchecked`` is false.
    """
    digests = {example.id: example.digest() for example in examples}
    kept = {}
    for key, record in records.items():
        wanted = digests.get(key[0])
        if wanted is None:
            continue
        theirs = record.get("example")
        if theirs is None and not unchecked:
            raise InvalidInputError(
                f"{origin}: its records name no example digest (made before kvedit recorded "
                f"one), so it cannot be checked that its {key[0]!r} is this run's (an id does "
                "not say --n-docs, --trials, --limit or --data); rerun those methods, or pass "
                "--reuse-unchecked to take its answers by id"
            )
        if theirs is not None and theirs != wanted:
            raise InvalidInputError(
                f"{origin}: its {key[0]!r} is another example than this run's (the same id over "
                "other documents or another question: was it run with other --n-docs, "
                "--trials, --limit or --data?)"
            )
        kept[key] = record
    return kept


def reused_records(
    path: str | Path,
    model: str,
    task: str,
    seed: int,
    params: dict[str, dict],
    prompt: str = "chat",
    engine: str = "transformers",
    source: str | None = None,
    trusted: Sequence[str] | None = None,
) -> dict[tuple[str, str], dict]:
    """The ``(id, method) -> record`` pairs of an earlier ``results.json`` worth reusing.

    ``source`` is the running kvedit's :func:`~kvedit.version.source_digest` (``None``: not
    checked). When the earlier run recorded another source, or none, its answers may come from
    other code: only the specs in ``trusted`` are reused, and with no ``trusted`` that is an
    :class:`~kvedit.errors.InvalidInputError`. ``trusted`` always limits the reuse to its specs,
    each of which must be one of this run's.

    The earlier run must be of the same model, task, seed, prompt format and engine (a file
    that recorded no format was made with ``"chat"``, one that recorded no engine with
    ``"transformers"``: the only ones there were). A method's records
    are reused only when that run recorded the same resolved parameters for its spec (a spec
    such as ``auto`` means other parameters once its defaults change), or, for files that
    recorded none, when the method takes no parameters (``none``, ``repeat``, ...).
    """
    res = read_json(path, "--reuse")
    extra = res.get("extra", {})
    examples = res.get("examples")
    if not isinstance(extra, dict) or not isinstance(examples, list):
        raise InvalidInputError(
            f"--reuse {path}: not a kvedit eval results.json (it needs an 'examples' list and "
            "an 'extra' object)"
        )
    for index, record in enumerate(examples):
        check_record(record, f"--reuse {path}: examples[{index}]")
    theirs = (res.get("model"), res.get("task"), extra.get("seed"))
    if theirs != (model, task, seed):
        raise InvalidInputError(
            f"--reuse {path}: made with model/task/seed {theirs}, not {(model, task, seed)}"
        )
    their_prompt = extra.get("prompt", "chat")
    if their_prompt != prompt:
        raise InvalidInputError(
            f"--reuse {path}: made with the prompt format {their_prompt!r}, not {prompt!r}"
        )
    their_engine = extra.get("engine", "transformers")
    if their_engine != engine:
        raise InvalidInputError(
            f"--reuse {path}: answered by the {their_engine!r} engine, not {engine!r}"
        )
    if trusted is not None:
        unknown = [spec for spec in trusted if spec not in params]
        if unknown:
            raise InvalidInputError(
                f"--reuse-methods {','.join(unknown)}: not among this run's methods "
                f"({','.join(params)})"
            )
    their_source = extra.get("kvedit", {}).get("source")
    if source is not None and their_source != source and trusted is None:
        made = f"source {their_source[:12]}" if their_source else "a source it did not record"
        raise InvalidInputError(
            f"--reuse {path}: made by other kvedit code ({made}; now {source[:12]}), so its "
            "answers may not be this code's; name the methods whose answers the change left "
            "alone with --reuse-methods (for example none)"
        )
    recorded = extra.get("params", {})
    same = {
        spec
        for spec, p in params.items()
        if (recorded[spec] == p if spec in recorded else not p)
        and (trusted is None or spec in trusted)
    }
    return {(r["id"], r["method"]): r for r in examples if r["method"] in same}


class PartialRecords:
    """A run's ``out/partial.jsonl`` (its records so far, one a line) and
    ``out/partial.settings.json`` (``settings``, which ``--resume`` compares), written with the
    first new records: a run refused or stopped before any leaves nothing. The records kept
    from an interrupted run (``done``) are written first; later records are appended."""

    def __init__(self, out: Path, settings: dict, done: Sequence[dict] = ()) -> None:
        self.path = out / "partial.jsonl"
        self.settings_path = out / "partial.settings.json"
        self.settings = settings
        self.done = list(done)
        self.started = False

    def add(self, records: Sequence[dict]) -> None:
        """Append ``records``; the first time, write the settings and the file anew."""
        lines = "".join(json.dumps(r) + "\n" for r in records)
        if self.started:
            with open(self.path, "a") as f:
                f.write(lines)
            return
        atomic_write(self.settings_path, json.dumps(self.settings, sort_keys=True).encode())
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in self.done) + lines)
        self.started = True

    def remove(self) -> None:
        """Remove both files (the run's results are written)."""
        self.path.unlink(missing_ok=True)
        self.settings_path.unlink(missing_ok=True)
