"""Storing a KVState: one safetensors file with JSON metadata in its header.

Layout: tensors ``layer.{i}.keys`` / ``.values`` ``[batch, kv_heads, n_i, head_dim]``,
``layer.{i}.token_index`` / ``.positions`` ``[n_i]``, optional ``layer.{i}.bias``
``[batch, heads, n_i]``, and ``token_ids``, ``offsets``, ``position_ids``, ``last_logits``. The
header's ``kvedit`` entry is JSON: format version, fingerprints, text, windows, and a CRC-32 of
every tensor's bytes. Files are written to a temporary file and renamed, so a reader never sees
a partial file. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CorruptCacheError
from .state import KVState, LayerKV

FORMAT = "kvedit.kvstate"
FORMAT_VERSION = 1
_MAX_HEADER = 100 * 2**20


def crc32_of(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 over the tensors' names and bytes, in name order (hex)."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(name.encode(), crc)
        if t.numel():
            crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
    return f"{crc:08x}"


def state_tensors(state: KVState, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state's tensors by file name, on CPU (K/V cast to ``dtype`` when given)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(state.layers):
        kv_dtype = dtype or layer.keys.dtype
        out[f"layer.{i}.keys"] = layer.keys.to("cpu", kv_dtype).contiguous()
        out[f"layer.{i}.values"] = layer.values.to("cpu", kv_dtype).contiguous()
        out[f"layer.{i}.token_index"] = layer.token_index.to("cpu").contiguous()
        out[f"layer.{i}.positions"] = layer.positions.to("cpu").contiguous()
        if layer.bias is not None:
            out[f"layer.{i}.bias"] = layer.bias.to("cpu", torch.float32).contiguous()
    out["token_ids"] = state.token_ids.cpu().contiguous()
    out["offsets"] = state.offsets.cpu().contiguous()
    out["position_ids"] = state.position_ids.cpu().contiguous()
    out["last_logits"] = state.last_logits.to("cpu", torch.float32).contiguous()
    return out


def state_metadata(state: KVState, tensors: dict[str, torch.Tensor]) -> dict:
    from . import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvedit_version": __version__,
        "model": getattr(state.model, "name_or_path", None),
        "model_fingerprint": state.model_fingerprint,
        "tokenizer_fingerprint": state.tokenizer_fingerprint,
        "text": state.text,
        "next_position": state.next_position,
        "windows": [layer.window for layer in state.layers],
        "n_layers": len(state.layers),
        "checksum": crc32_of(tensors),
    }


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call ``write(tmp_path)`` then fsync and rename onto ``path``; never leaves a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def save_state(state: KVState, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``state`` to ``path`` (see module docstring); ``dtype`` down-casts keys and values."""
    tensors = state_tensors(state, dtype)
    meta = {"kvedit": json.dumps(state_metadata(state, tensors), ensure_ascii=False)}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


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


def read_verified(
    path: str | os.PathLike, fmt: str, version: int, what: str = "format"
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a kvedit safetensors file of format ``fmt``: header sniffed, JSON metadata parsed,
    format and version checked, CRC verified. Returns ``(metadata, tensors)``.

    Raises :class:`CorruptCacheError` for anything else (truncated, corrupted, a pickle).
    """
    path = Path(path)
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
    if meta.get("format_version") != version:
        raise CorruptCacheError(
            f"{path}: {what} version {meta.get('format_version')} is not supported "
            f"(this kvedit reads version {version})"
        )
    if crc32_of(tensors) != meta.get("checksum"):
        raise CorruptCacheError(f"{path}: checksum mismatch, the file is corrupted")
    return meta, tensors


def read_state_file(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and verify a state file. Returns ``(metadata, tensors)`` or raises CorruptCacheError."""
    return read_verified(path, FORMAT, FORMAT_VERSION)


def state_from_parts(meta: dict, tensors: dict[str, torch.Tensor], model, tokenizer) -> KVState:
    """Build a state from verified file contents, on the model's device and dtype."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    try:
        layers = []
        for i, window in enumerate(meta["windows"]):
            bias = tensors.get(f"layer.{i}.bias")
            layers.append(
                LayerKV(
                    keys=tensors[f"layer.{i}.keys"].to(device, dtype),
                    values=tensors[f"layer.{i}.values"].to(device, dtype),
                    token_index=tensors[f"layer.{i}.token_index"],
                    positions=tensors[f"layer.{i}.positions"],
                    bias=None if bias is None else bias.to(device),
                    window=window,
                )
            )
        state = KVState(
            layers=layers,
            token_ids=tensors["token_ids"],
            offsets=tensors["offsets"],
            text=meta["text"],
            position_ids=tensors["position_ids"],
            next_position=int(meta["next_position"]),
            last_logits=tensors["last_logits"].to(device),
            model_fingerprint=meta["model_fingerprint"],
            tokenizer_fingerprint=meta["tokenizer_fingerprint"],
            model=model,
            tokenizer=tokenizer,
        )
    except KeyError as e:
        raise CorruptCacheError(f"state file lacks tensor or field {e}") from e
    return state


def load_state(path: str | os.PathLike, model, tokenizer) -> KVState:
    """Load a state saved with :meth:`KVState.save`, checking it belongs to ``model``/``tokenizer``.

    Raises:
        CorruptCacheError: truncated, corrupted, not a kvedit file, or a pickle.
        CacheMismatchError: the state was made by another model or tokenizer.
    """
    meta, tensors = read_state_file(path)
    state = state_from_parts(meta, tensors, model, tokenizer)
    state.check_compatible(model, tokenizer)
    return state
