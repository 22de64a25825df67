"""Learned: KVzip's scores predicted from each entry's own key and value, fit once per model.

KVzap (Jegou & Jeblick, 2026, arXiv:2601.07891; in kvpress) predicts KVzip's score of each
(token, KV head) from the token's hidden state with one small linear map per layer, fit once
per model: about 1% of a layer's cost, and no re-read of the text. kvedit fits the same kind of
map on what a cache already holds, so it scores any cache with no model pass at all (a memory's
entries as they arrive, a loaded file, K/V another engine computed): per global layer, a ridge
map from an entry's *key with its rotation undone* (its pre-RoPE key, :mod:`kvedit.rope`) and its
*value*, all KV heads together, to the log of its :class:`~kvedit.compress.scorers.kvzip.KVzip`
score on each KV head. Key and value are linear maps of the layer's normalized input, so they
carry what KVzap reads from the hidden state through the layer's own projections.

A fit is one sealed safetensors file per model, made by ``kvedit memory fit-scorer --model M``
(:mod:`kvedit.evals.fitting`); the fits of the bundled models ship. Its format, its seal and
where it is found (the file given, then the user's fits, then the shipped ones) are in
:mod:`.fits`. A fit is refused for any other model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...cache import LayerKV, is_headwise, refuse_headwise
from ...errors import CacheMismatchError, CorruptCacheError, InvalidInputError
from ...states.state import KVState
from .base import Scorer, register_scorer
from .fits import FITTED_DIR, FORMAT, USER_DIR, Fitted, fit_folders, fitted_for, user_dir

__all__ = [
    "FITTED_DIR",
    "FORMAT",
    "USER_DIR",
    "Fitted",
    "Learned",
    "entry_features",
    "fit_folders",
    "fitted_for",
    "user_dir",
]


def entry_features(state: KVState, layer: int, entries: torch.Tensor | None = None):
    """``[m, features]`` float32: per entry of layer ``layer`` (all its slots, or the slot
    indices ``entries``), its key on every KV head with the rotation undone, then its value on
    every KV head (batch row 0). A headwise layer's slots hold other tokens on each head: each
    head's key is un-rotated from its own position (a padding slot's features are zeros), and
    a slot's features are one entry's only where every head holds the same token there."""
    from ...rope import movers

    model, _ = state.require_model()
    held: LayerKV = state.layers[layer]
    keys, values = held.dense_kv()
    if is_headwise(held):
        positions = held.head_positions
    else:
        positions = held.positions[None].expand(keys.shape[1], -1)
    if entries is not None:
        keys, values = keys[..., entries, :], values[..., entries, :]
        positions = positions[:, entries.to(positions.device)]
    mover = movers(model)[layer]
    keys = torch.stack(
        [
            mover.move(keys[:, h : h + 1].float(), -positions[h].clamp_min(0).to(keys.device))[:, 0]
            for h in range(keys.shape[1])
        ],
        dim=1,
    )
    k = keys[0].transpose(0, 1).flatten(1)  # [m, kv_heads * head_dim]
    v = values[0].float().transpose(0, 1).flatten(1)
    return torch.cat([k, v], dim=1)


@register_scorer("learned")
@dataclass(frozen=True)
class Learned(Scorer):
    """KVzip's scores predicted from each entry's own key and value (module docstring).

    Attributes:
        path: a fit's file; None: the fit shipped for the state's model.
    """

    path: str | None = None

    arrival: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    reads_model: ClassVar[bool] = False  # its fit reads K/V; the model only names the fit

    def refuses(self, state: KVState) -> str | None:
        try:
            self.fitted(state)
        except (InvalidInputError, CacheMismatchError, CorruptCacheError) as e:
            return str(e)
        return None

    def fitted(self, state: KVState) -> Fitted:
        """The fit this scorer uses for ``state``'s model (checked once per call)."""
        model, _ = state.require_model()
        return fitted_for(model, self.path)

    def fit_digest(self, state: KVState) -> str:
        """The digest (seal) of the fit this scorer uses for ``state``'s model
        (:attr:`Fitted.digest`): scores of two fits compare only under the same digest."""
        return self.fitted(state).digest

    def scores_key(self, state: KVState) -> str | None:
        """The fit's digest (:meth:`fit_digest`): a refit's scores never mix with the old."""
        return self.fit_digest(state)

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{layer: [batch, kv_heads, n]}`` predicted log KVzip scores.

        Raises:
            InvalidInputError: a headwise layer (its slots hold other tokens on each head, so
                a slot's features, every head's key and value, would mix tokens).
        """
        refuse_headwise(state.layers, "the learned scorer's scoring of a whole state")
        fit = self.fitted(state)
        return {i: fit.predict(i, entry_features(state, i))[None] for i in layers}

    def score_tokens(
        self, state: KVState, start: int, end: int, layers: Sequence[int]
    ) -> dict[int, torch.Tensor]:
        """``{layer: [batch, kv_heads, m]}`` for layer ``i``'s entries of tokens
        ``[start, end)``, in the layer's order."""
        fit = self.fitted(state)
        out = {}
        tokens = torch.arange(start, end)
        for i in layers:
            entries = state.layers[i].entries_for(tokens)
            out[i] = fit.predict(i, entry_features(state, i, entries))[None]
        return out
