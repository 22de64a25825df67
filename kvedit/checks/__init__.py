"""Validators for the arguments of kvedit's public functions, and the limits a call is held to.

Each validator returns the value in canonical form (a ``float``, an ``int``, a tuple of layer
indices...) or raises a :class:`~kvedit.errors.KVEditError` that names the argument and says what
was expected. A value of the wrong type raises :class:`~kvedit.errors.InvalidTypeError` (both a
``TypeError`` and a ``ValueError``); a value of the right type outside its range raises
:class:`~kvedit.errors.InvalidInputError` (a ``ValueError``).

Every name is imported from here (``from kvedit import checks``; ``checks.count(...)``); one
concern per module:

- :mod:`~kvedit.checks.values`: argument values (numbers, counts, strengths, flags, texts,
  layer indices, signatures, paths, storage dtypes) and the caps on a strength, a key scale and
  a duplication's copies.
- :mod:`~kvedit.checks.lengths`: how long a context or a call may be (a model's positions,
  :data:`MAX_TOKENS_PER_CALL`), refused before any work.
- :mod:`~kvedit.checks.state_fits`: whether a state's cache fits a model
  (:func:`state_fits_model`).
"""

from __future__ import annotations

from .lengths import (
    MAX_CHARS_PER_TOKEN,
    MAX_TOKENS_PER_CALL,
    call_size,
    context_fits,
    positions_hint,
    positions_limit,
)
from .state_fits import state_fits_model
from .values import (
    MAX_DUPLICATE_COPIES,
    MAX_SCALE_FACTOR,
    MAX_STRENGTH,
    call_refusal,
    count,
    describe,
    flag,
    layers,
    path,
    real,
    save_dtype,
    share,
    strength,
    text,
)

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
    "flag",
    "layers",
    "path",
    "positions_hint",
    "positions_limit",
    "real",
    "save_dtype",
    "share",
    "state_fits_model",
    "strength",
    "text",
]
