"""Provenance: where a state came from and every transformation applied to it, in order.

A :class:`History` is an :class:`Origin` (a capture of token ids by a model and tokenizer, a
projection, a blend, or ``"unknown"`` for a file written before kvedit 0.3) and a tuple of
:class:`Step` s (an edit, a lossy compression, a dtype cast, a re-read...), each with its
parameters and whether it is exact. ``KVState.history`` holds it; ops append to it with
``KVState.with_step``; state files save it in their metadata.

:func:`content_digest` names what a state holds: a stable hash of the model fingerprint, the
token ids and the history (origin kind and steps, not where a file was read from). Two states
with the same digest were built the same way from the same ids by the same model, so they attend
identically. A file's seal (a CRC-32 before format 4, :mod:`kvedit.states.files.format`) is
something else: a check of its bytes, and with this installation's key of who wrote them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ORIGINS",
    "STEP_KINDS",
    "History",
    "Origin",
    "Step",
    "cast_step",
    "content_digest",
    "dtype_name",
    "token_ranges",
]

ORIGINS = ("capture", "projection", "blend", "unknown")
"""How a state's entries were first made: ``capture`` (the model ran over the ids), a
``projection`` of another model's state, a ``blend`` of separately cached passages, or
``unknown`` (a file written before kvedit 0.3 recorded nothing)."""

STEP_KINDS = (
    "edit",
    "compression",
    "cast",
    "reread",
    "approximation",
    "computed",
    "reposition",
)
"""What a step did: an ``edit`` of attention (bias, scaled keys, copies), a ``compression``
(selection, quantization, merging), a dtype ``cast``, a ``reread`` (entries appended at new
positions), an ``approximation`` (another engine realising an edit approximately), or
entries ``computed`` by another engine (vLLM's kernels: kvedit's own entries only within float
tolerance), or a ``reposition`` (entries given new positions, their keys re-rotated: a memory's
compact positions, :mod:`kvedit.memory.repositioning`)."""


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON (sorted keys, floats kept exactly as ``repr`` writes them;
    tensors as lists, dtypes by name, anything else by ``repr``)."""
    if hasattr(value, "tolist") and callable(value.tolist):  # tensors, numpy arrays and scalars
        return _canonical(value.tolist())
    if _is_dtype(value):
        return dtype_name(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    return repr(value)


def _is_dtype(value: Any) -> bool:
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32`` (or the string itself)."""
    return str(dtype).removeprefix("torch.")


# Dtypes whose every value another dtype holds exactly: a cast along these is lossless.
_WIDER = {
    "float16": {"float32", "float64"},
    "bfloat16": {"float32", "float64"},
    "float32": {"float64"},
}


def token_ranges(indices: Any) -> list[list[int]]:
    """Sorted token indices as ``[[start, stop), ...]`` runs: how a step names the tokens it
    touched, compactly (``[3, 4, 5, 9]`` is ``[[3, 6], [9, 10]]``)."""
    values = sorted({int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)})
    runs: list[list[int]] = []
    for i in values:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


@dataclass(frozen=True)
class Step:
    """One transformation: ``kind`` (one of :data:`STEP_KINDS`), ``name`` (the op: ``emphasize``,
    ``quantize``, ``cast``...), its ``params`` (JSON-able) and whether it is ``exact`` (an edit
    applied as asked; ``False``: lossy or approximate)."""

    kind: str
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    exact: bool = True

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step kind {self.kind!r} is not one of {STEP_KINDS}")
        object.__setattr__(self, "params", _canonical(dict(self.params)))

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "params": self.params, "exact": self.exact}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Step:
        """A step as a file recorded it, parsed strictly: ``kind`` and ``name`` strings,
        ``params`` an object, ``exact`` a JSON boolean (``"no"`` is not false).

        Raises:
            ValueError: a field is missing or of the wrong JSON type.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a step must be an object, not {type(data).__name__}")
        kind, name = _json_field(data, "kind", str), _json_field(data, "name", str)
        params, exact = _json_field(data, "params", dict), _json_field(data, "exact", bool)
        return cls(kind, name, params, exact)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{self.name}({args}){'' if self.exact else ' ~inexact'}"


def _json_field(data: Mapping[str, Any], name: str, kind: type) -> Any:
    """``data[name]``, which must be of JSON type ``kind`` (a bool is not an int, nor the
    reverse)."""
    if name not in data:
        raise ValueError(f"missing field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"field {name!r} must be a JSON {kind.__name__}, not {value!r}")
    return value


def cast_step(source: Any, target: Any) -> Step:
    """The step of casting K/V from dtype ``source`` to ``target``: exact when ``target`` holds
    every value of ``source`` (float16 or bfloat16 to float32, anything to itself)."""
    src, dst = dtype_name(source), dtype_name(target)
    exact = src == dst or dst in _WIDER.get(src, ())
    return Step("cast", "cast", {"dtype": dst, "from": src}, exact=exact)


def _short(value: Any, limit: int = 8) -> str:
    """A parameter as printed: long lists cut to their first ``limit`` items."""
    if isinstance(value, list) and len(value) > limit:
        head = ", ".join(_short(v) for v in value[:limit])
        return f"[{head}, ... {len(value)} in all]"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    if isinstance(value, str) and len(value) > 16 and all(c in "0123456789abcdef" for c in value):
        return f"{value[:12]}..."  # a fingerprint or digest: its head names it well enough
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Origin:
    """How the state's entries were first made (``kind``: one of :data:`ORIGINS`), with the
    parameters that made them (``params``: the source model of a projection, say) and the file
    it was last read from (``path``; not part of the digest)."""

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ORIGINS:
            raise ValueError(f"origin {self.kind!r} is not one of {ORIGINS}")
        object.__setattr__(self, "params", _canonical(dict(self.params)))

    def to_json(self) -> dict:
        return {"kind": self.kind, "params": self.params}


@dataclass(frozen=True)
class History:
    """Where a state came from and what was done to it since (:class:`Origin`, :class:`Step` s)."""

    origin: Origin = field(default_factory=lambda: Origin("unknown"))
    steps: tuple[Step, ...] = ()

    @classmethod
    def captured(cls, dtype: Any = None) -> History:
        """The history of a fresh capture: the model ran over the ids, nothing since.
        ``dtype``: the dtype the model computed K/V in (model fingerprints do not depend on
        it, the entries do)."""
        return cls(Origin("capture", {} if dtype is None else {"dtype": dtype_name(dtype)}))

    @classmethod
    def unknown(cls, path: str | None = None) -> History:
        """No history: a file written before kvedit 0.3 (or a state built without one)."""
        return cls(Origin("unknown", path=path))

    @property
    def known(self) -> bool:
        return self.origin.kind != "unknown"

    @property
    def exact(self) -> bool:
        """Every step exact (lossy compressions, lossy casts and approximations are not)."""
        return all(step.exact for step in self.steps)

    @property
    def plain(self) -> bool:
        """A capture with nothing done to it but exact casts (:meth:`first_change` is None)."""
        return self.first_change() is None

    def then(self, step: Step) -> History:
        """This history followed by ``step``.

        A cast back to the dtype an exact cast came from, with nothing in between (no step,
        and as many tokens: ``at_tokens``), undoes it (every value was held exactly, so the
        round trip restores them bit for bit): both steps are dropped, and a bfloat16 capture
        saved as float32 and loaded in bfloat16 is a plain capture again.
        """
        if step.kind == "cast" and self.steps:
            last = self.steps[-1]
            if (
                last.kind == "cast"
                and last.exact
                and step.params.get("dtype") == last.params.get("from")
                and step.params.get("at_tokens") == last.params.get("at_tokens")
            ):
                return History(self.origin, self.steps[:-1])
        return History(self.origin, (*self.steps, step))

    def read_from(self, path: str) -> History:
        """The same history, noting the file it was read from."""
        return History(Origin(self.origin.kind, self.origin.params, path), self.steps)

    def first_change(self, allowed: Sequence[Any] = ()) -> str | None:
        """What keeps this from being a plain capture: ``None`` for a capture whose steps are all
        exact casts, or casts to a dtype in ``allowed`` (dtypes or their names, declared
        acceptable); else a phrase naming the origin or the first other step."""
        if not self.known:
            return "an unknown history (a file written before kvedit 0.3, or a state built by hand)"
        if self.origin.kind != "capture":
            params = ", ".join(f"{k}={_short(v)}" for k, v in self.origin.params.items())
            return f"a {self.origin.kind} ({params})" if params else f"a {self.origin.kind}"
        names = {dtype_name(d) for d in allowed}
        for step in self.steps:
            declared = step.kind == "cast" and step.params.get("dtype") in names
            if step.kind != "cast" or not (step.exact or declared):
                return f"{step.kind} {step}"
        return None

    def to_json(self) -> dict:
        return {"origin": self.origin.to_json(), "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, path: str | None = None) -> History:
        """The history a file recorded (``None``: an older file, :meth:`unknown`)."""
        if data is None:
            return cls.unknown(path)
        if not isinstance(data, Mapping):
            raise ValueError(f"a history must be an object, not {type(data).__name__}")
        origin = _json_field(data, "origin", dict)
        params = origin.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"origin params must be an object, not {type(params).__name__}")
        steps = _json_field(data, "steps", list)
        return cls(
            Origin(_json_field(origin, "kind", str), params, path),
            tuple(Step.from_json(s) for s in steps),
        )

    def __str__(self) -> str:
        where = f" from {self.origin.path}" if self.origin.path else ""
        params = ", ".join(f"{k}={_short(v)}" for k, v in self.origin.params.items())
        head = f"{self.origin.kind}{f'({params})' if params else ''}{where}"
        return " -> ".join([head, *(str(s) for s in self.steps)])


def content_digest(model_fingerprint: str, token_ids: Sequence[int], history: History) -> str:
    """A stable hex digest naming what a state holds: model, token ids and history (origin kind
    and parameters, every step; never the path a file was read from)."""
    payload = json.dumps(
        {
            "model": model_fingerprint,
            "ids": [int(t) for t in token_ids],
            "history": history.to_json(),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
