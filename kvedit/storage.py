"""Storing a KVState: one safetensors file with JSON metadata in its header.

Layout: tensors ``layer.{i}.keys`` / ``.values`` ``[batch, kv_heads, n_i, head_dim]``,
``layer.{i}.token_index`` / ``.positions`` ``[n_i]``, optional ``layer.{i}.bias``
``[batch, heads, n_i]``, and ``token_ids``, ``offsets``, ``position_ids``, ``last_logits``. The
header's ``kvedit`` entry is JSON: format version, fingerprints, text, windows, and a CRC-32 of
every tensor's bytes. Files are written by :func:`kvedit.atomic.atomic_write` (a temporary
name, fsync, rename), so a reader never sees a partial file. Nothing is ever unpickled.

Format versions: 2 (this kvedit) records the model fingerprint of
:func:`kvedit.fingerprint.model_fingerprint` (whole tensors, dtype-independent), the token
count and each layer's entry count. Version 1 files (kvedit 0.1) are still read: their model
fingerprint (:func:`kvedit.fingerprint.legacy_model_fingerprint`) is checked and the loaded
state carries the current one. A loaded file's structure (layers, KV heads, head size,
windows, sizes) is checked against the model before the state is built.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open

from . import checks
from .atomic import atomic_write
from .cache import layer_class
from .errors import CacheMismatchError, CorruptCacheError, InvalidInputError, InvalidTypeError
from .fingerprint import legacy_model_fingerprint, model_fingerprint, tokenizer_fingerprint
from .state import KVState
from .statefile import (
    FORMAT,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    crc32_of,
    save_state,
    state_metadata,
    state_tensors,
)

_MAX_HEADER = 100 * 2**20

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "atomic_write",
    "crc32_of",
    "load_state",
    "read_state_file",
    "read_verified",
    "save_state",
    "state_from_parts",
    "state_metadata",
    "state_tensors",
]


def _check_header(path: Path) -> None:
    """Reject what is not a plausible safetensors file before parsing it.

    A safetensors file is an 8-byte little-endian header length, then a JSON header starting
    with ``{``. Only when that shape is absent is the file sniffed for a pickle or a zip
    (``torch.save``), to name what it is; the first byte alone proves nothing (a header length
    can end in 0x80).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(9)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCacheError(f"{path}: cannot read: {e}") from e
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    if len(head) == 9 and head[8:9] == b"{" and 0 < n <= _MAX_HEADER and 8 + n <= size:
        return
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise CorruptCacheError(
            f"{path}: looks like a pickle or torch.save archive; kvedit never unpickles files"
        )
    if len(head) < 9:
        raise CorruptCacheError(f"{path}: truncated ({size} bytes), not a safetensors file")
    raise CorruptCacheError(f"{path}: bad or truncated safetensors header (length {n})")


def _read_path(path) -> Path:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    if not os.fspath(path):
        raise InvalidInputError("path is empty: give the file to read")
    return Path(path)


def read_verified(
    path: str | os.PathLike, fmt: str, version: int | Collection[int], what: str = "format"
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a kvedit safetensors file of format ``fmt``: header sniffed, JSON metadata parsed,
    format and version checked (``version``: the one readable version, or several), CRC
    verified. Returns ``(metadata, tensors)``.

    Raises :class:`CorruptCacheError` for anything else (truncated, corrupted, a pickle).
    """
    path = _read_path(path)
    _check_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCacheError(f"{path}: unreadable safetensors file: {e}") from e
    try:
        meta = json.loads(raw_meta["kvedit"])
    except (KeyError, json.JSONDecodeError) as e:
        raise CorruptCacheError(f"{path}: no kvedit metadata in the header") from e
    if meta.get("format") != fmt:
        raise CorruptCacheError(f"{path}: format {meta.get('format')!r} is not {fmt!r}")
    versions = (version,) if isinstance(version, int) else tuple(version)
    found = meta.get("format_version")
    if isinstance(found, bool) or found not in versions:
        readable = " or ".join(str(v) for v in versions)
        raise CorruptCacheError(
            f"{path}: {what} version {found} is not supported "
            f"(this kvedit reads version {readable})"
        )
    if crc32_of(tensors) != meta.get("checksum"):
        raise CorruptCacheError(f"{path}: checksum mismatch, the file is corrupted")
    return meta, tensors


def read_state_file(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and verify a state file (any of :data:`READABLE_VERSIONS`).

    Returns ``(metadata, tensors)`` or raises CorruptCacheError.
    """
    return read_verified(path, FORMAT, READABLE_VERSIONS)


def _check_layout(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The metadata describes the tensors the file holds: as many layers, no stray ones."""
    windows = meta.get("windows")
    if not isinstance(windows, list) or not all(
        w is None or (isinstance(w, int) and not isinstance(w, bool) and w > 0) for w in windows
    ):
        raise CorruptCacheError(f"bad windows {windows!r} in the metadata")
    n_layers = meta.get("n_layers", len(windows))
    if n_layers != len(windows):
        raise CorruptCacheError(f"n_layers {n_layers!r} but {len(windows)} windows")
    held = {int(name.split(".")[1]) for name in tensors if name.startswith("layer.")}
    if held != set(range(len(windows))):
        raise CorruptCacheError(
            f"the metadata lists {len(windows)} layers but the file holds layer tensors "
            f"{sorted(held)[:10]}{' ...' if len(held) > 10 else ''}"
        )
    entries = meta.get("layer_entries")
    if entries is not None:
        found = [tensors[f"layer.{i}.token_index"].shape[0] for i in range(len(windows))]
        if entries != found:
            raise CorruptCacheError(f"layer_entries {entries} but the keys hold {found}")
    if "n_tokens" in meta and meta["n_tokens"] != tensors["token_ids"].shape[0]:
        raise CorruptCacheError(
            f"n_tokens {meta['n_tokens']} but {tensors['token_ids'].shape[0]} token ids"
        )


def state_from_parts(meta: dict, tensors: dict[str, torch.Tensor], model, tokenizer) -> KVState:
    """Build a state from verified file contents, on the model's device and dtype.

    The file's structure is checked first against itself (its metadata against its tensors)
    and against ``model`` (layers, windows, KV heads, head size, vocabulary, token indices and
    positions in range): a file that does not fit raises :class:`CorruptCacheError`, before
    it can fail later inside the model. Fingerprints are not compared here (see
    :func:`load_state`).
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    try:
        _check_layout(meta, tensors)
        text = meta["text"]
        if not isinstance(text, str):
            raise TypeError(f"text is a {type(text).__name__}")
        next_position = meta["next_position"]
        if not isinstance(next_position, int) or isinstance(next_position, bool):
            raise TypeError(f"next_position is {next_position!r}")
        windows = meta["windows"]
        kinds = meta.get("layer_kinds") or ["dense"] * len(windows)
        params = meta.get("layer_params") or [{} for _ in windows]
        if len(kinds) != len(windows) or len(params) != len(windows):
            raise CorruptCacheError(f"{len(kinds)} layer kinds for {len(windows)} layers")
        layers = []
        for i, (window, kind, layer_params) in enumerate(zip(windows, kinds, params, strict=True)):
            prefix = f"layer.{i}."
            mine = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
            shared = layer_params.get("shared") if isinstance(layer_params, dict) else None
            if shared is not None:  # data the layer shares with others, written once
                block = f"shared.{shared}."
                found = {k[len(block) :]: t for k, t in tensors.items() if k.startswith(block)}
                if not found:
                    raise CorruptCacheError(
                        f"layer {i} names shared data {shared!r} the file lacks"
                    )
                mine.update({f"shared.{k}": t for k, t in found.items()})
            cls = layer_class(kind)
            layers.append(cls.from_tensors(mine, layer_params, window, device, dtype))
        state = KVState(
            layers=layers,
            token_ids=tensors["token_ids"],
            offsets=tensors["offsets"],
            text=text,
            position_ids=tensors["position_ids"],
            next_position=next_position,
            last_logits=tensors["last_logits"].to(device),
            model_fingerprint=str(meta["model_fingerprint"]),
            tokenizer_fingerprint=str(meta["tokenizer_fingerprint"]),
            model=model,
            tokenizer=tokenizer,
        )
    except KeyError as e:
        raise CorruptCacheError(f"state file lacks tensor or field {e}") from e
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CorruptCacheError(f"state file has a malformed field: {e}") from e
    checks.state_fits_model(state, model, fingerprints=False, deep=True, error=CorruptCacheError)
    return state


def _check_fingerprints(meta: dict, model, tokenizer, path) -> dict:
    """Refuse a file made by another model or tokenizer (:class:`CacheMismatchError`).

    A version-1 file records the fingerprint of kvedit 0.1, compared with
    :func:`~kvedit.fingerprint.legacy_model_fingerprint`; the returned metadata then carries
    the current fingerprint, so the loaded state (and a file saved from it) is version 2.
    """
    problems = []
    mfp = model_fingerprint(model)
    stored = meta.get("model_fingerprint")
    if meta.get("format_version") == 1 and stored == legacy_model_fingerprint(model):
        meta = {**meta, "model_fingerprint": mfp}
    elif stored != mfp:
        legacy = (
            " (a version-1 file: kvedit 0.1's fingerprint)"
            if meta.get("format_version") == 1
            else ""
        )
        problems.append(
            f"model fingerprint {mfp} != state's {stored}{legacy} "
            f"(model {getattr(model, 'name_or_path', '?')!r})"
        )
    tfp = tokenizer_fingerprint(tokenizer)
    if tfp != meta.get("tokenizer_fingerprint"):
        problems.append(
            f"tokenizer fingerprint {tfp} != state's {meta.get('tokenizer_fingerprint')}"
        )
    if problems:
        raise CacheMismatchError(
            f"{path}: this cache was made by another model: " + "; ".join(problems)
        )
    return meta


def load_state(path: str | os.PathLike, model, tokenizer) -> KVState:
    """Load a state saved with :meth:`KVState.save`, checking it belongs to ``model``/``tokenizer``.

    Reads format versions 1 and 2. The fingerprints are compared first, then the file's
    structure is checked against the model (:func:`state_from_parts`).

    Raises:
        CorruptCacheError: truncated, corrupted, not a kvedit file, a pickle, or a structure
            (layers, KV heads, head size, windows, sizes) that does not fit the model its
            fingerprint names.
        CacheMismatchError: the state was made by another model or tokenizer.
        FileNotFoundError: there is no file at ``path``.
    """
    meta, tensors = read_state_file(path)
    meta = _check_fingerprints(meta, model, tokenizer, path)
    return state_from_parts(meta, tensors, model, tokenizer)
