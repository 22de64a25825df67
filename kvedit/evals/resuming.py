"""What a run of the lost-in-the-middle suite keeps of earlier runs: the records an interrupted
run left in ``DIR/partial.jsonl`` (``--resume``, checked against the settings written beside them
when it started, ``DIR/partial.settings.json``) and an earlier run's answers (``--reuse``), each
taken only for the same examples (:func:`~kvedit.evals.jsonl.matching_records`).
:func:`kvedit.evals.litm.evaluate` says when each applies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidInputError
from kvedit.evals.jsonl import matching_records, read_json, read_records, reused_records
from kvedit.evals.schema import Example

__all__ = ["resumable", "resumed", "reused", "start_partial"]


def reused(
    reuse: str | Path | None,
    reuse_methods: Sequence[str] | None,
    reuse_unchecked: bool,
    settings: dict,
    examples: Sequence[Example],
) -> dict[tuple[str, str], dict]:
    """The records :func:`~kvedit.evals.litm.evaluate` takes from ``reuse`` for a run with
    ``settings`` (the resume settings: model, task, seed, prompt, engine, params, source),
    checked against ``examples``; ``{}`` without ``reuse``. Refuses ``reuse_methods`` or
    ``reuse_unchecked`` without ``reuse``."""
    if reuse_methods is not None and reuse is None:
        raise InvalidInputError(
            "--reuse-methods names methods to take from --reuse, which is not given"
        )
    if reuse_unchecked and reuse is None:
        raise InvalidInputError("--reuse-unchecked is about --reuse, which is not given")
    taken = {}
    if reuse is not None:
        keys = ("model", "task", "seed", "params", "prompt", "engine", "source")
        taken = reused_records(reuse, **{k: settings[k] for k in keys}, trusted=reuse_methods)
    return matching_records(taken, examples, f"--reuse {reuse}", unchecked=reuse_unchecked)


def start_partial(
    out: Path, settings: dict, done: dict[tuple[str, str], dict]
) -> tuple[Path, Path]:
    """Create ``out`` and start ``out/partial.jsonl`` with the records ``done`` (those
    :func:`resumed` kept), the settings beside it: ``(partial, settings path)``."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "partial.jsonl"
    settings_path = out / "partial.settings.json"
    atomic_write(settings_path, json.dumps(settings, sort_keys=True).encode())
    atomic_write(partial, "".join(json.dumps(r) + "\n" for r in done.values()))
    return partial, settings_path


def resumed(out: Path, settings: dict, examples: Sequence[Example]) -> dict[tuple[str, str], dict]:
    """The records ``--resume`` keeps from ``out/partial.jsonl`` (:func:`resumable`, checked
    against ``examples``); ``{}`` when there is none. Reads only: nothing is written."""
    partial = out / "partial.jsonl"
    if not partial.exists():
        return {}
    done = resumable(partial, out / "partial.settings.json", settings)
    return matching_records(done, examples, f"--resume: {partial}")


def resumable(partial: Path, settings_path: Path, settings: dict) -> dict[tuple[str, str], dict]:
    """The records of ``partial`` an interrupted run with ``settings`` may keep.

    The interrupted run must have had the same model, task, seed, prompt format and answer
    length (``partial.settings.json``, written when it started); else, or when that file is
    missing, :class:`~kvedit.errors.InvalidInputError`. Records of a method whose parameters
    resolved differently then are dropped (recomputed)."""
    if not settings_path.exists():
        raise InvalidInputError(
            f"--resume: {partial} has no {settings_path.name}, so the run it came from cannot "
            "be checked; delete it or run without --resume"
        )
    theirs = read_json(settings_path, "--resume")
    if not isinstance(theirs.get("params"), dict):
        raise InvalidInputError(f"--resume {settings_path}: no 'params' object (not kvedit's)")
    theirs.setdefault("engine", "transformers")  # written before there was a choice
    differ = [
        f"{k} {theirs.get(k)!r} (now {v!r})"
        for k, v in settings.items()
        if k not in ("params", "source") and theirs.get(k) != v
    ]
    if theirs.get("source") != settings["source"]:
        differ.append(
            "kvedit's source (the interrupted run's answers may not be what this code gives; "
            "delete the file to start again)"
        )
    if differ:
        raise InvalidInputError(f"--resume: {partial} came from another run: " + ", ".join(differ))
    same = {spec for spec, p in settings["params"].items() if theirs["params"].get(spec) == p}
    records = read_records(partial, "--resume")
    return {(r["id"], r["method"]): r for r in records if r["method"] in same}
