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

A fit is one safetensors file (:class:`Fitted`): per layer ``mean``/``scale`` (the features'
standardization), ``weight`` ``[features, kv_heads]``, ``bias`` ``[kv_heads]``, and JSON metadata
naming the model (:func:`kvedit.fingerprint.model_fingerprint`) and recording the fit
(conversations, samples, held-out R², the command). ``kvedit memory fit-scorer --model M`` makes
one (:mod:`kvedit.evals.fitting`); the fits of the bundled models ship in
:data:`FITTED_DIR`. A fit is refused for any other model.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ...cache import LayerKV, is_headwise, refuse_headwise
from ...errors import CacheMismatchError, CorruptCacheError, InvalidInputError
from ...states.state import KVState
from .base import Scorer, register_scorer

__all__ = [
    "FITTED_DIR",
    "FORMAT",
    "USER_DIR",
    "Fitted",
    "Learned",
    "entry_features",
    "fit_folders",
    "fitted_for",
]

FORMAT = "kvedit-learned-scorer/1"
"""The ``format`` in a fit's metadata."""

FITTED_DIR = Path(__file__).resolve().parent / "fitted"
"""Where the fits of the bundled models ship (one ``.safetensors`` file each)."""

USER_DIR = "scorers"
"""The folder of :func:`kvedit.models.cache_dir` where ``kvedit memory fit-scorer`` writes a
fit by default, searched after :data:`FITTED_DIR`."""


def fit_folders() -> list[Path]:
    """Where a fit is looked for, in order: the shipped ones, then the user's."""
    from ...models import cache_dir

    return [FITTED_DIR, cache_dir() / USER_DIR]


MAX_FILE_BYTES = 64 * 2**20
"""The largest fit file read: a linear map per layer of a model up to ~70B is a few MB."""

_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {(path, file version): Fitted}: a fit is read once, not at every message."""


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


@dataclass(frozen=True)
class Fitted:
    """A fit: per layer the standardization and the linear map, and its metadata.

    Attributes:
        layers: ``{layer: (mean [F], scale [F], weight [F, kv_heads], bias [kv_heads])}``.
        meta: JSON-ready: ``format``, ``model`` (fingerprint), ``model_name``, ``target``,
            ``fit`` (how it was made and how well it predicts held-out scores).
    """

    layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    meta: dict = field(default_factory=dict)

    def predict(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, m]`` predicted log scores of ``features`` ``[m, F]``, on their device
        (the maps are read on the CPU, the features come from the cache's device)."""
        if layer not in self.layers:
            raise InvalidInputError(f"the learned scorer has no map for layer {layer}")
        mean, scale, weight, bias = (t.to(features.device) for t in self.layers[layer])
        if features.shape[1] != mean.shape[0]:
            raise CacheMismatchError(
                f"layer {layer}: {features.shape[1]} features, the fit expects {mean.shape[0]}"
            )
        return (((features - mean) / scale) @ weight + bias).T

    def save(self, path: str | os.PathLike) -> Path:
        """Write the fit to ``path`` (safetensors, atomically)."""
        from safetensors.torch import save

        from ...atomic import atomic_write

        tensors = {}
        for i, (mean, scale, weight, bias) in self.layers.items():
            for name, t in (("mean", mean), ("scale", scale), ("weight", weight), ("bias", bias)):
                tensors[f"layer.{i}.{name}"] = t.float().contiguous()
        meta = {"kvedit": json.dumps({**self.meta, "format": FORMAT}, sort_keys=True)}
        return atomic_write(Path(path), save(tensors, metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Fitted:
        """A fit written by :meth:`save`.

        Raises:
            CorruptCacheError: not a fit (missing, too large, not safetensors, bad metadata or
                tensors), naming the file.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load

        path = Path(path)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise CorruptCacheError(f"{path}: larger than a fit ({MAX_FILE_BYTES} bytes)")
            data = path.read_bytes()
            tensors = load(data)
            meta = json.loads(_metadata(data).get("kvedit", "{}"))
        except (OSError, SafetensorError, ValueError) as e:
            raise CorruptCacheError(f"{path}: not a learned scorer's fit ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptCacheError(f"{path}: not a learned scorer's fit (format {FORMAT})")
        layers: dict = {}
        for name, t in tensors.items():
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit():
                raise CorruptCacheError(f"{path}: unexpected tensor {name!r}")
            layers.setdefault(int(parts[1]), {})[parts[2]] = t.float()
        out = {}
        for i, parts in layers.items():
            if set(parts) != {"mean", "scale", "weight", "bias"}:
                raise CorruptCacheError(f"{path}: layer {i} lacks part of its map")
            f, h = parts["weight"].shape
            if (
                parts["mean"].shape != (f,)
                or parts["scale"].shape != (f,)
                or parts["bias"].shape != (h,)
            ):
                raise CorruptCacheError(f"{path}: layer {i}'s map has inconsistent shapes")
            if not all(bool(torch.isfinite(t).all()) for t in parts.values()) or bool(
                (parts["scale"] == 0).any()
            ):  # a NaN score is never kept (rank_keep reads NaN as padding), however good
                raise CorruptCacheError(
                    f"{path}: layer {i}'s map is not finite (NaN, infinite or a zero scale)"
                )
            out[i] = (parts["mean"], parts["scale"], parts["weight"], parts["bias"])
        return cls(out, meta)


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors byte string."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__", {}) or {}


def fitted_for(model, path: str | os.PathLike | None = None) -> Fitted:
    """The fit for ``model``: the file ``path``, or the shipped fit whose fingerprint is the
    model's.

    Raises:
        InvalidInputError: no fit ships for this model (fit one: ``kvedit memory fit-scorer``).
        CacheMismatchError: ``path`` is a fit of another model.
    """
    key = None
    if path is not None:
        try:
            key = (str(Path(path).resolve()), *_file_version(Path(path)))
        except OSError:
            return _find(model, path)  # refused there, naming the file
    found = _FOUND.setdefault(model, {})
    if key is not None and key in found:
        return found[key]
    if path is None:
        key = tuple(
            (str(p), *_file_version(p))
            for d in fit_folders()
            for p in sorted(d.glob("*.safetensors"))
        )
    if key in found:
        return found[key]
    fitted = _find(model, path)
    found[key] = fitted
    return fitted


def _file_version(path: Path) -> tuple[int, ...]:
    """What tells one version of a file from another: its inode, size, and modification and
    change times (a file replaced keeps neither its inode nor its change time, even where the
    modification time is coarse or copied over, as ``cp -p`` and ``rsync -t`` do)."""
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _find(model, path) -> Fitted:
    """:func:`fitted_for` without its cache."""
    from ...fingerprint import model_fingerprint

    mine = model_fingerprint(model)
    if path is not None:
        fitted = Fitted.load(path)
        if fitted.meta.get("model") != mine:
            raise CacheMismatchError(
                f"{path}: a learned scorer fit for another model "
                f"({fitted.meta.get('model_name', '?')}); fit one for this model with "
                "`kvedit memory fit-scorer`"
            )
        return fitted
    for folder in fit_folders():
        for candidate in sorted(folder.glob("*.safetensors")):
            fitted = Fitted.load(candidate)
            if fitted.meta.get("model") == mine:
                return fitted
    raise InvalidInputError(
        "no learned scorer is fit for this model (kvedit ships fits for its bundled models); "
        "fit one with `kvedit memory fit-scorer --model ...` (it is then found in "
        f"{fit_folders()[1]}), or use forget='kvzip'"
    )


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
