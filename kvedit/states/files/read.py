"""Reading a state file (the format: :mod:`kvedit.states.files.format`) and checking it.

:func:`load_state` reads, verifies (header sniffed, format, version, the seal over header and
tensors: :mod:`kvedit.states.files.seal`) and
checks the file against the model (fingerprints, layers, KV heads, head size, windows, sizes)
before the state is built. Nothing is ever unpickled. The file is read through one open
(:mod:`kvedit.states.files.snapshot`): header and tensors come from the same version, whatever a
concurrent writer renames onto the name meanwhile. The state's history comes from the file
when this installation wrote it (older or foreign files: unknown), with a cast step when the file's K/V dtype is not the
model's. Version 1 files (kvedit 0.1): their model
fingerprint (:func:`kvedit.fingerprint.legacy_model_fingerprint`) is checked and the loaded
state carries the current one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import checks
from ...atomic import sweep_stale
from ...cache import layer_class
from ...errors import CacheMismatchError, CorruptCacheError, InvalidInputError, InvalidTypeError
from ...fingerprint import legacy_model_fingerprint, model_fingerprint, tokenizer_fingerprint
from ...provenance import History, cast_step, dtype_name
from ..state import KVState, LastInput
from .format import ATTACHED, FORMAT, READABLE_VERSIONS, SEALED_VERSION, crc32_of
from .seal import VERIFIED, Seal, check_header, check_tensors, tensors_digest
from .snapshot import FileSnapshot, read_snapshot

__all__ = [
    "AttachedFile",
    "load_attached",
    "read_attached",
    "SealedFile",
    "load_state",
    "read_sealed",
    "read_state_file",
    "read_verified",
    "state_from_parts",
]


def _read_path(path) -> Path:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    if not os.fspath(path):
        raise InvalidInputError("path is empty: give the file to read")
    return Path(path)


def _read_raw(path: Path) -> tuple[dict, FileSnapshot]:
    """The header's ``kvedit`` entry (parsed JSON) and the snapshot of the file (every tensor,
    the version read), all read through one open file (:func:`read_snapshot`). What a killed
    writer of the file left beside it is swept first (:func:`kvedit.atomic.sweep_stale`)."""
    sweep_stale(path)
    snapshot = read_snapshot(path)
    try:
        meta = json.loads(snapshot.metadata["kvedit"])
    except (KeyError, json.JSONDecodeError) as e:
        raise CorruptCacheError(f"{path}: no kvedit metadata in the header") from e
    if not isinstance(meta, dict):
        raise CorruptCacheError(f"{path}: the kvedit metadata is not a JSON object")
    return meta, snapshot


def _check_version(meta: dict, path, fmt: str, versions: tuple[int, ...], what: str) -> int:
    if meta.get("format") != fmt:
        raise CorruptCacheError(f"{path}: format {meta.get('format')!r} is not {fmt!r}")
    found = meta.get("format_version")
    if isinstance(found, bool) or found not in versions:
        readable = " or ".join(str(v) for v in versions)
        raise CorruptCacheError(
            f"{path}: {what} version {found} is not supported "
            f"(this kvedit reads version {readable})"
        )
    return found


@dataclass(frozen=True)
class SealedFile:
    """A verified file: its header entry ``meta``, its ``tensors``, its ``seal`` (None for a
    version before sealing, whose CRC-32 was checked instead), and the ``version`` of the file
    read (``(device, inode, size, mtime_ns, ctime_ns)`` of the one open it was read through;
    None where not known)."""

    meta: dict
    tensors: dict[str, torch.Tensor]
    seal: Seal | None
    version: tuple | None = None

    @property
    def trusted(self) -> bool:
        """This installation wrote the file (its MAC verifies): its claims can be believed."""
        return self.seal is not None and self.seal.trusted


def read_sealed(
    path: str | os.PathLike,
    fmt: str,
    version: int | Collection[int],
    what: str = "format",
    sealed_from: int | None = SEALED_VERSION,
) -> SealedFile:
    """Read a kvedit safetensors file of format ``fmt``: header sniffed, JSON metadata parsed,
    format and version checked (``version``: the one readable version, or several), then the
    seal of a version from ``sealed_from`` on (:mod:`kvedit.states.files.seal`; a file version
    already hashed by this process is not hashed again) or the CRC-32 of an older one
    (``sealed_from=None``: a format never sealed, always its CRC-32).

    Raises :class:`CorruptCacheError` for anything else (truncated, corrupted, edited, a pickle).
    """
    path = _read_path(path)
    meta, snapshot = _read_raw(path)  # one open: header and tensors of the same version
    tensors, read = snapshot.tensors, snapshot.version
    versions = (version,) if isinstance(version, int) else tuple(version)
    found = _check_version(meta, path, fmt, versions, what)
    if sealed_from is None or found < sealed_from:
        if crc32_of(tensors) != meta.get("checksum"):
            raise CorruptCacheError(f"{path}: checksum mismatch, the file is corrupted")
        return SealedFile(meta, tensors, None, read)
    seal = check_header(meta, path)
    # a file version (inode, size, times) already hashed, with the same recorded digest; a
    # file written in place while it was read is hashed whatever it was
    seen = None if snapshot.changed else (read, seal.tensors)
    if not VERIFIED.seen(seen):
        check_tensors(seal, tensors_digest(tensors), path)
        VERIFIED.add(seen)
    return SealedFile(meta, tensors, seal, read)


def read_verified(
    path: str | os.PathLike, fmt: str, version: int | Collection[int], what: str = "format"
) -> tuple[dict, dict[str, torch.Tensor]]:
    """:func:`read_sealed` for a format whose files carry a CRC-32 (never a seal): returns
    ``(metadata, tensors)``."""
    found = read_sealed(path, fmt, version, what, sealed_from=None)
    return found.meta, found.tensors


def read_state_file(path: str | os.PathLike) -> SealedFile:
    """Read and verify a state file (any of :data:`READABLE_VERSIONS`): its seal (version 4)
    or CRC-32 (older versions). ``trusted`` says whether this installation wrote it.

    Raises CorruptCacheError.
    """
    return read_sealed(path, FORMAT, READABLE_VERSIONS)


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


def _history(meta: dict, path, trusted: bool) -> History:
    """The history a file records, believed only when this installation wrote the file
    (``trusted``); otherwise unknown (a foreign file, or one older than version 4)."""
    where = None if path is None else str(path)
    if not trusted or meta.get("format_version", 0) < SEALED_VERSION:
        return History.unknown(where)
    try:
        return History.from_json(meta["history"], where)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCacheError(f"{where}: malformed history in the metadata: {e}") from e


def _file_kv_dtype(meta: dict, tensors: dict[str, torch.Tensor]) -> str | None:
    """The dtype the file's keys and values are written in: recorded (version 3), else read off
    the first layer's K/V data (older files; None when there is none to read)."""
    if meta.get("format_version", 0) >= 3:
        found = meta.get("kv_dtype")
        if found is not None and not isinstance(found, str):
            raise CorruptCacheError(f"bad kv_dtype {found!r} in the metadata")
        return found
    for name in ("keys", "tail.keys", "keys.residual"):
        t = tensors.get(f"layer.0.{name}")
        if t is not None:
            return dtype_name(t.dtype)
    return None


def _last_input(meta: dict, layers, n: int, next_position: int) -> LastInput | None:
    """The entry the file's last logits follow: recorded (version 3), else the entry at the
    last position (``next_position - 1``; what a re-read appended last), else None (the last
    text token)."""
    found = meta.get("last_input")
    if found is not None:
        if (
            not isinstance(found, list)
            or len(found) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in found)
            or not 0 <= found[0] < n
        ):
            raise CorruptCacheError(f"bad last_input {found!r} in the metadata")
        return LastInput(*found)
    for layer in layers:
        at = (layer.positions == next_position - 1).nonzero().flatten()
        if at.numel():
            index = int(layer.token_index[at[-1]])
            return LastInput(index, next_position - 1) if 0 <= index < n else None
    return None


def state_from_parts(
    meta: dict,
    tensors: dict[str, torch.Tensor],
    model,
    tokenizer,
    path=None,
    *,
    trusted: bool = False,
    max_positions: int | None = None,
) -> KVState:
    """Build a state from verified file contents, on the model's device and dtype.

    The file's structure is checked first against itself (its metadata against its tensors)
    and against ``model`` (layers, windows, KV heads, head size, vocabulary, token indices and
    positions in range): a file that does not fit raises :class:`CorruptCacheError`, before
    it can fail later inside the model. Fingerprints are not compared here (see
    :func:`load_state`).

    The state's history is the file's when ``trusted`` (this installation wrote the file:
    :attr:`SealedFile.trusted`), else unknown (``path``, the file read, is noted in its
    origin), followed by a cast step when the file's K/V dtype is not the model's (they are
    cast to the model's on load). ``max_positions`` is the state's
    :attr:`~kvedit.KVState.max_positions` (a runtime setting no file holds).
    """
    if max_positions is not None:  # outside the try: a bad value is no corrupt file
        max_positions = checks.count("max_positions", max_positions, minimum=1)
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
        token_ids = tensors["token_ids"]
        state = KVState(
            layers=layers,
            token_ids=token_ids,
            offsets=tensors["offsets"],
            text=text,
            position_ids=tensors["position_ids"],
            next_position=next_position,
            last_logits=tensors["last_logits"].to(device),
            model_fingerprint=str(meta["model_fingerprint"]),
            tokenizer_fingerprint=str(meta["tokenizer_fingerprint"]),
            history=_history(meta, path, trusted),
            last_input=_last_input(meta, layers, int(token_ids.shape[0]), next_position),
            max_positions=max_positions,
            model=model,
            tokenizer=tokenizer,
        )
        stored = _file_kv_dtype(meta, tensors)
        if stored is not None and stored != dtype_name(dtype):
            state = state.with_step(cast_step(stored, dtype))
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
    the current fingerprint, so the loaded state (and a file saved from it) has it.
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


def load_state(
    path: str | os.PathLike, model, tokenizer, *, max_positions: int | None = None
) -> KVState:
    """Load a state saved with :meth:`KVState.save`, checking it belongs to ``model``/``tokenizer``.

    Reads format versions 1 to 4. The seal (version 4; a CRC-32 before) is checked first, then
    the fingerprints, then the file's structure against the model (:func:`state_from_parts`).
    The state's history is the file's when this installation wrote it (its seal's MAC
    verifies); any other file loads with an unknown history (``history.origin.path`` notes the
    file): usable, but never stored or served as a capture. A cast step follows when the
    file's K/V dtype is not the model's. ``max_positions``: the most positions the model
    attends to, for the checks of every later call (:attr:`KVState.max_positions`; None: the
    model config's); files do not hold it.

    Raises:
        CorruptCacheError: truncated, corrupted, edited by hand, not a kvedit file, a pickle, or a structure
            (layers, KV heads, head size, windows, sizes) that does not fit the model its
            fingerprint names.
        CacheMismatchError: the state was made by another model or tokenizer.
        FileNotFoundError: there is no file at ``path``.
    """
    return load_attached(path, model, tokenizer, max_positions=max_positions)[0]


def load_attached(
    path: str | os.PathLike, model, tokenizer, *, max_positions: int | None = None
) -> tuple[KVState, dict | None]:
    """:func:`load_state`, and the file's ``attachment`` (the metadata
    :func:`~kvedit.states.files.write.save_state` was given; None when it was given none).
    The attachment is covered by the seal: a file edited by hand is refused like any other.

    Raises:
        CorruptCacheError: as :func:`load_state`, or an ``attachment`` that is not a JSON object.
    """
    found = read_attached(path, model, tokenizer, max_positions=max_positions)
    return found.state, found.attachment


@dataclass(frozen=True)
class AttachedFile:
    """A state file read by :func:`read_attached`: the ``state``, the header's ``attachment``
    (None when it has none), whether this installation wrote it (``trusted``: its seal's MAC
    verifies, so its history and attachment are what the writer was given), and the
    ``version`` of the file read (:attr:`SealedFile.version`)."""

    state: KVState
    attachment: dict | None
    trusted: bool
    version: tuple | None
    tensors: dict[str, torch.Tensor] | None = None


def read_attached(
    path: str | os.PathLike, model, tokenizer, *, max_positions: int | None = None
) -> AttachedFile:
    """:func:`load_attached`, with whether the file is trusted and the version read.

    Raises:
        CorruptCacheError: as :func:`load_attached`.
    """
    if max_positions is not None:  # before reading: a bad value is no corrupt file
        max_positions = checks.count("max_positions", max_positions, minimum=1)
    found = read_state_file(path)
    meta = _check_fingerprints(found.meta, model, tokenizer, path)
    state = state_from_parts(
        meta,
        found.tensors,
        model,
        tokenizer,
        path=path,
        trusted=found.trusted,
        max_positions=max_positions,
    )
    attachment = found.meta.get("attachment")
    if attachment is not None and not isinstance(attachment, dict):
        raise CorruptCacheError(f"{path}: the header's attachment is not a JSON object")
    attached = {
        name[len(ATTACHED) :]: t for name, t in found.tensors.items() if name.startswith(ATTACHED)
    }
    return AttachedFile(state, attachment, found.trusted, found.version, attached)
