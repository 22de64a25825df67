"""The learned scorer's fits: their file format, their seal and where they are found.

A fit is one safetensors file (:class:`Fitted`): per layer ``mean``/``scale`` (the features'
standardization), ``weight`` ``[features, kv_heads]``, ``bias`` ``[kv_heads]``, and JSON metadata
naming the model (:func:`kvedit.fingerprint.model_fingerprint`) and recording the fit
(conversations, samples, held-out R², the command). The metadata carries the fit's seal,
``digest``: the SHA-256 of its maps and the rest of its metadata (:attr:`Fitted.digest`),
checked when the file is read, so a fit changed after it was written (its maps or its
metadata: the model it names, say) is refused by name, and so is a fit without a seal.

Where a fit is found for a model (:func:`fitted_for`), first match wins:

1. the file given (``Learned(path=...)``), refused if it is another model's;
2. the user's fits, :func:`user_dir` (``$KVEDIT_CACHE/scorers``, where ``kvedit memory
   fit-scorer`` writes by default): a refit there wins over the shipped one;
3. the fits shipped for the bundled models, :data:`FITTED_DIR`.

In a folder the files are tried in name order; the first whose model is the one asked wins.
A folder's listing is kept until the folder changes (a file added, removed or replaced), and
the fit found is read again only when its file changes: scoring a message stats two folders
and one file, not every fit.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ...errors import CacheMismatchError, CorruptCacheError, InvalidInputError

__all__ = [
    "FITTED_DIR",
    "FORMAT",
    "MAX_FILE_BYTES",
    "USER_DIR",
    "Fitted",
    "fit_folders",
    "fitted_for",
    "user_dir",
]

FORMAT = "kvedit-learned-scorer/1"
"""The ``format`` in a fit's metadata."""

FITTED_DIR = Path(__file__).resolve().parent / "fitted"
"""Where the fits of the bundled models ship (one ``.safetensors`` file each)."""

USER_DIR = "scorers"
"""The folder of :func:`kvedit.models.cache_dir` where ``kvedit memory fit-scorer`` writes a
fit by default, searched before :data:`FITTED_DIR`."""

MAX_FILE_BYTES = 64 * 2**20
"""The largest fit file read: a linear map per layer of a model up to ~70B is a few MB."""

_PARTS = ("mean", "scale", "weight", "bias")


def user_dir() -> Path:
    """The user's fits: :data:`USER_DIR` in kvedit's cache folder."""
    from ...models import cache_dir

    return cache_dir() / USER_DIR


def fit_folders() -> list[Path]:
    """Where a fit is looked for when none is given, in order: the user's, then the shipped."""
    return [user_dir(), FITTED_DIR]


def _seal(layers: dict, meta: dict) -> str:
    """SHA-256 (hex) of the maps (each layer's parts: name, shape and float32 bytes, in layer
    order) and of ``meta`` but its ``digest`` (JSON, sorted keys)."""
    h = hashlib.sha256()
    for i in sorted(layers):
        for name, t in zip(_PARTS, layers[i]):
            t = t.detach().to("cpu", torch.float32).contiguous()
            h.update(f"{i}.{name}:{tuple(t.shape)}\0".encode())
            h.update(t.numpy().tobytes())
    rest = {k: v for k, v in meta.items() if k != "digest"}
    h.update(json.dumps(rest, sort_keys=True).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Fitted:
    """A fit: per layer the standardization and the linear map, and its metadata.

    Attributes:
        layers: ``{layer: (mean [F], scale [F], weight [F, kv_heads], bias [kv_heads])}``.
        meta: JSON-ready: ``format``, ``model`` (fingerprint), ``model_name``, ``target``,
            ``fit`` (how it was made and how well it predicts held-out scores); a fit read from
            a file also its ``digest``.
    """

    layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    meta: dict = field(default_factory=dict)

    @cached_property
    def digest(self) -> str:
        """The fit's seal: SHA-256 (hex) of its maps and its metadata (what :meth:`save`
        writes and :meth:`load` checks); two fits with the same digest score alike."""
        return _seal(self.layers, {**self.meta, "format": FORMAT})

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
        """Write the fit to ``path`` (safetensors, atomically), sealed with its digest."""
        from safetensors.torch import save

        from ...atomic import atomic_write

        tensors = {}
        for i, parts in self.layers.items():
            for name, t in zip(_PARTS, parts):
                tensors[f"layer.{i}.{name}"] = t.float().contiguous()
        meta = {**self.meta, "format": FORMAT, "digest": self.digest}
        return atomic_write(
            Path(path), save(tensors, metadata={"kvedit": json.dumps(meta, sort_keys=True)})
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Fitted:
        """A fit written by :meth:`save`, its seal checked.

        Raises:
            CorruptCacheError: not a fit (missing, too large, not safetensors, bad metadata or
                tensors), or one without a seal or changed since it was sealed, naming the file.
        """
        path = Path(path)
        tensors, meta = _read(path)
        out = {}
        for i, parts in _layer_parts(path, tensors).items():
            _check_layer(path, i, parts)
            out[i] = tuple(parts[name] for name in _PARTS)
        digest = meta.get("digest")
        if not isinstance(digest, str):
            raise CorruptCacheError(
                f"{path}: a learned scorer's fit without a seal (a digest of its maps; written "
                "by an older kvedit or by hand): fit it again with `kvedit memory fit-scorer`"
            )
        if _seal(out, meta) != digest:
            raise CorruptCacheError(
                f"{path}: a learned scorer's fit changed since it was sealed (its maps or its "
                "metadata do not match its digest): fit it again with `kvedit memory fit-scorer`"
            )
        return cls(out, meta)


def _read(path: Path) -> tuple[dict, dict]:
    """The tensors and the metadata of the fit file ``path`` (its format checked)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

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
    return tensors, meta


def _layer_parts(path: Path, tensors: dict) -> dict[int, dict[str, torch.Tensor]]:
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit():
            raise CorruptCacheError(f"{path}: unexpected tensor {name!r}")
        layers.setdefault(int(parts[1]), {})[parts[2]] = t.float()
    return layers


def _check_layer(path: Path, i: int, parts: dict[str, torch.Tensor]) -> None:
    if set(parts) != set(_PARTS) or parts["weight"].dim() != 2:
        raise CorruptCacheError(f"{path}: layer {i} lacks part of its map")
    f, h = parts["weight"].shape
    if parts["mean"].shape != (f,) or parts["scale"].shape != (f,) or parts["bias"].shape != (h,):
        raise CorruptCacheError(f"{path}: layer {i}'s map has inconsistent shapes")
    if not all(bool(torch.isfinite(t).all()) for t in parts.values()) or bool(
        (parts["scale"] == 0).any()
    ):  # a NaN score is never kept (rank_keep reads NaN as padding), however good
        raise CorruptCacheError(
            f"{path}: layer {i}'s map is not finite (NaN, infinite or a zero scale)"
        )


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors byte string."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__", {}) or {}


# ------------------------------------------------------------------------------ finding a fit

_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {key: (Fitted, its file, the file's version)}: a fit is read once, not at every
message (the key: the file given and its version, or the folders' versions)."""

_LISTINGS: dict[Path, tuple[tuple[int, ...], list[Path]]] = {}
"""folder -> (its version, its fit files in name order): listed again when the folder changes."""


def _file_version(path: Path) -> tuple[int, ...]:
    """What tells one version of a file (or folder) from another: its inode, size, and
    modification and change times (a file replaced keeps neither its inode nor its change time,
    even where the modification time is coarse or copied over, as ``cp -p`` and ``rsync -t``
    do; a folder's change when an entry is added, removed or renamed)."""
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _version_or_none(path: Path) -> tuple[int, ...] | None:
    try:
        return _file_version(path)
    except OSError:
        return None


def listing(folder: Path) -> list[Path]:
    """The fit files of ``folder`` in name order (none when it is missing), listed once per
    version of the folder."""
    version = _version_or_none(folder)
    if version is None:
        _LISTINGS.pop(folder, None)
        return []
    kept = _LISTINGS.get(folder)
    if kept is not None and kept[0] == version:
        return kept[1]
    files = sorted(folder.glob("*.safetensors"))
    _LISTINGS[folder] = (version, files)
    return files


def fitted_for(model, path: str | os.PathLike | None = None) -> Fitted:
    """The fit for ``model``: the file ``path``, else the first of the user's fits and then
    the shipped ones whose model is ``model`` (module docstring).

    Raises:
        InvalidInputError: no fit is found for this model (fit one: ``kvedit memory
            fit-scorer``).
        CacheMismatchError: ``path`` is a fit of another model.
        CorruptCacheError: a fit file that is not one, unsealed or changed since sealed.
    """
    if path is not None:
        given = Path(path)
        key: tuple = ("file", str(given.resolve()))
    else:
        given = None
        folders = fit_folders()
        key = ("folders", *((str(f), _version_or_none(f)) for f in folders))
    found = _FOUND.setdefault(model, {})
    kept = found.get(key)
    if kept is not None and _version_or_none(kept[1]) == kept[2]:
        return kept[0]
    if given is not None:
        version = _version_or_none(given)
        fitted, file = _check_model(model, Fitted.load(given), given), given
    else:
        fitted, file = _search(model, folders)
        version = _version_or_none(file)
        for old in [k for k in found if k[0] == "folders"]:  # the folders' older versions
            del found[old]
    found[key] = (fitted, file, version)
    return fitted


def _check_model(model, fitted: Fitted, path: Path) -> Fitted:
    from ...fingerprint import model_fingerprint

    if fitted.meta.get("model") != model_fingerprint(model):
        raise CacheMismatchError(
            f"{path}: a learned scorer fit for another model "
            f"({fitted.meta.get('model_name', '?')}); fit one for this model with "
            "`kvedit memory fit-scorer`"
        )
    return fitted


def _search(model, folders: list[Path]) -> tuple[Fitted, Path]:
    """The first fit of ``folders`` (in order, each in name order) whose model is ``model``."""
    from ...fingerprint import model_fingerprint

    mine = model_fingerprint(model)
    for folder in folders:
        for candidate in listing(folder):
            fitted = Fitted.load(candidate)
            if fitted.meta.get("model") == mine:
                return fitted, candidate
    raise InvalidInputError(
        "no learned scorer is fit for this model (kvedit ships fits for its bundled models); "
        "fit one with `kvedit memory fit-scorer --model ...` (it is then found in "
        f"{folders[0]}), or use forget='kvzip'"
    )
