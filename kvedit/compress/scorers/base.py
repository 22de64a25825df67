"""The scorer protocol and the registry of scorers by name.

A scorer says how much each cache entry is worth keeping, per KV head: ``score(state, layers)``
returns, for each layer index asked for, a ``[batch, kv_heads, n]`` float tensor (``n`` the
layer's entries; higher is kept first). :func:`kvedit.compress.select` does the keeping, the
same way for every scorer. A scorer may give ``+inf`` to entries it insists on (SnapKV's
observation window): they are kept before any finite score, the latest first when a head's
budget cannot hold them all.

``budgets(scores, budget)`` splits a layer's budget over its heads; the default gives every head
the same ``budget``, :class:`kvedit.compress.AdaKV` shares it by score mass.

A scorer also says what a forgetting :class:`kvedit.Memory` (``forget=NAME``, any registered
name) may do with it, as class attributes, so no list of names elsewhere has to know:
``arrival`` (it scores entries once, when they arrive, :meth:`Scorer.score_tokens`, and the
scores are kept: nothing is re-read), ``shared`` (its scores compare across layers, so one
ranking shares the budget among them), ``whole_words`` (a word is kept or forgotten whole),
``reads_model`` (it runs the model, a forward pass over the state, to score: a server, whose
model runs in another engine, may use only scorers that do not), :meth:`Scorer.refuses`
(why it cannot serve a state's model) and :meth:`Scorer.refuses_config` (the same, where the
model's configuration alone tells, so before its weights load).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from ...errors import InvalidInputError
from ...registry import Registry
from ...states.state import KVState

__all__ = ["SCORERS", "Scorer", "make_scorer", "register_scorer"]


class Scorer:
    """Base class of the scorers (subclasses are frozen dataclasses of their parameters)."""

    name: ClassVar[str] = "scorer"
    """The registered name (set by :func:`register_scorer`)."""

    arrival: ClassVar[bool] = False
    """Scores entries when they arrive (:meth:`score_tokens`), comparable with later ones."""
    shared: ClassVar[bool] = False
    """Its scores compare across layers: a memory ranks all global layers' entries together."""
    whole_words: ClassVar[bool] = False
    """A memory keeps or forgets a word whole (an entry's score its word's best)."""
    reads_model: ClassVar[bool] = True
    """It runs the model (a forward pass over the state) to score; False: it scores from the
    cache alone (its K/V, positions and indices, and what the model's config says), so a server
    whose model runs in another engine may use it. True unless a scorer says otherwise."""

    def refuses(self, state: KVState) -> str | None:
        """Why this scorer cannot score ``state``'s model (None when it can)."""
        return None

    def refuses_config(self, config: Any) -> str | None:
        """Why this scorer cannot score a model of ``config`` (a transformers config), where
        the configuration alone tells: a check before the weights load. None when it can, or
        when the configuration cannot tell (:meth:`refuses` decides once a state exists)."""
        return None

    def scores_key(self, state: KVState) -> str | None:
        """What this scorer's scores of ``state``'s model depend on beyond its name (a learned
        fit's digest): scores kept under another key are not comparable and are made again.
        None: the name says it all."""
        return None

    def score_tokens(
        self, state: KVState, start: int, end: int, layers: Sequence[int]
    ) -> dict[int, torch.Tensor]:
        """``{layer: [batch, kv_heads, m]}``: the scores of each layer's entries of tokens
        ``[start, end)``, in the layer's order (``arrival`` scorers only)."""
        raise NotImplementedError(f"scorer {self.name!r} scores whole states, not arrivals")

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{layer index: [batch, kv_heads, n] scores}`` for each of ``layers``."""
        raise NotImplementedError

    def budgets(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """How many entries each KV head keeps: ``[batch, kv_heads]`` ints summing to
        ``kv_heads * budget`` per batch row. ``scores`` ``[batch, kv_heads, n]`` are the
        layer's scores as :func:`~kvedit.compress.select` ranks them (``+inf`` on entries that
        must be kept, ``-inf`` on entries a head already dropped). Uniform by default."""
        b, heads, _ = scores.shape
        return torch.full((b, heads), budget, dtype=torch.long, device=scores.device)


SCORERS: Registry[type[Scorer]] = Registry("scorer")
"""Scorer name -> scorer class (a :class:`kvedit.registry.Registry`)."""

ScorerType = TypeVar("ScorerType", bound=type[Scorer])


def register_scorer(name: str) -> Callable[[ScorerType], ScorerType]:
    """Class decorator registering a :class:`Scorer` subclass (a dataclass whose fields all
    have defaults) under ``name`` in :data:`SCORERS`; registering the same class again is
    allowed.

    Raises:
        InvalidInputError: ``name`` is not an identifier, or is taken by another class.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidInputError(f"bad scorer name {name!r}")

    def decorator(cls: ScorerType) -> ScorerType:
        SCORERS.register(name, cls)
        cls.name = name
        return cls

    return decorator


def make_scorer(name: str, **params: Any) -> Scorer:
    """The scorer registered as ``name``, with ``params`` (its dataclass fields).

    Raises:
        InvalidInputError: an unknown name or parameter, or a value the scorer refuses.
    """
    cls = SCORERS.lookup(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise InvalidInputError(
            f"scorer {name!r}: unknown parameter(s) {unknown}; known: {sorted(fields) or 'none'}"
        )
    return cls(**params)
