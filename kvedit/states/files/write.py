"""Writing a state file (the format: :mod:`kvedit.states.files.format`), atomically.

Files are written by :func:`kvedit.atomic.atomic_write` (a temporary name, fsync, rename), so a
reader never sees a partial file. This module imports nothing of :mod:`kvedit.states.state`, so
the state can import it: a state is typed :class:`~kvedit.states.view.StateView` here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ... import checks
from ...atomic import atomic_write, sweep_leftovers
from ...errors import InvalidInputError, InvalidTypeError
from ...provenance import History, cast_step, dtype_name
from ...version import __version__
from ..view import StateView
from .format import ATTACHED, FORMAT, FORMAT_VERSION
from .seal import make_seal, tensors_digest

__all__ = [
    "ATTACHED",
    "SavedFile",
    "save_file_version",
    "save_state",
    "saved_history",
    "state_metadata",
    "state_tensors",
]


def _cast(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    out = t.to("cpu", dtype).contiguous()
    overflow = dtype != t.dtype and out.numel() and not bool(torch.isfinite(out).all())
    if overflow and bool(torch.isfinite(t).all()):
        raise InvalidInputError(
            f"{what} overflow {dtype} (largest |value| {float(t.abs().max()):.4g}); "
            "save them as bfloat16 or float32"
        )
    return out


def state_tensors(state: StateView, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state's tensors by file name, on CPU (K/V cast to ``dtype`` when given).

    Raises:
        InvalidInputError: ``dtype`` is not a float dtype (:func:`kvedit.checks.save_dtype`), or
            keys or values do not fit in it (float16 overflows at 65504).
    """
    return _state_tensors_and_params(state, dtype)[0]


def _state_tensors_and_params(
    state: StateView, dtype: torch.dtype | None, seen: set[torch.dtype] | None = None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Tensors by file name and each layer's params; ``seen`` collects the dtypes the K/V data
    had before the cast."""
    dtype = checks.save_dtype(dtype)
    seen = set() if seen is None else seen
    out: dict[str, torch.Tensor] = {}
    params = []
    written: set[str] = set()
    for i, layer in enumerate(state.layers):

        def cast(t: torch.Tensor, what: str, i: int = i) -> torch.Tensor:
            seen.add(t.dtype)
            return _cast(t, dtype or t.dtype, f"layer {i}'s {what}")

        tensors, layer_params = layer.to_tensors(cast)
        out.update({f"layer.{i}.{name}": t for name, t in tensors.items()})
        params.append(layer_params)
        shared = layer.shared_tensors(cast)
        if shared is not None:  # data several layers share (a merged pair): written once
            key, block = shared
            if key not in written:
                written.add(key)
                out.update({f"shared.{key}.{name}": t for name, t in block.items()})
    out["token_ids"] = state.token_ids.cpu().contiguous()
    out["offsets"] = state.offsets.cpu().contiguous()
    out["position_ids"] = state.position_ids.cpu().contiguous()
    out["last_logits"] = state.last_logits.to("cpu", torch.float32).contiguous()
    return out, params


def saved_history(state: StateView, seen: set[torch.dtype], dtype: torch.dtype | None) -> History:
    """The history of what a file holds: the state's, then the cast of its K/V to ``dtype``
    (one step per dtype the K/V had, when ``dtype`` is another)."""
    history = state.history
    if dtype is None:
        return history
    for source in sorted(seen, key=str):
        if source != dtype:
            history = state.replace(history=history).with_step(cast_step(source, dtype)).history
    return history


def state_metadata(
    state: StateView,
    layer_params: list[dict] | None = None,
    *,
    history: History | None = None,
    kv_dtype: torch.dtype | None = None,
) -> dict:
    """The ``kvedit`` header entry of a state file (:mod:`kvedit.states.files.format`).
    ``history``: what the file holds (default: the state's); ``kv_dtype``: the dtype its
    keys and values are written in (default: the state's)."""
    history = state.history if history is None else history
    if kv_dtype is None and state.layers:
        kv_dtype = _kv_dtype(state)
    last = state.last_input
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
        "n_tokens": len(state),
        "layer_entries": [len(layer) for layer in state.layers],
        "layer_kinds": [layer.kind for layer in state.layers],
        "layer_params": layer_params or [{} for _ in state.layers],
        "history": history.to_json(),
        "kv_dtype": None if kv_dtype is None else dtype_name(kv_dtype),
        "last_input": None if last is None else [last.token_index, last.position],
    }


def _kv_dtype(state: StateView) -> torch.dtype | None:
    """The dtype of the state's keys and values, read off a lossless layer (nothing is
    dequantized to find it); None when every layer is packed."""
    for layer in state.layers:
        if layer.lossless:
            return layer.keys.dtype
    return None


@dataclass(frozen=True)
class SavedFile:
    """A file :func:`save_file_version` wrote: its ``path`` and the ``version`` written
    (``(device, inode, size, mtime_ns)``, taken from the file before it was renamed onto
    ``path``: what a later ``os.stat(path)`` gives while no other writer replaced it)."""

    path: Path
    version: tuple[int, int, int, int]


def save_state(
    state: StateView,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    *,
    attachment: dict | None = None,
) -> Path:
    """Write ``state`` to ``path`` (see module docstring); ``dtype`` down-casts keys and values.
    ``attachment``: JSON-ready metadata of whoever holds the state (a
    :class:`kvedit.Memory`'s messages), written in the header under ``attachment`` and covered
    by the seal; :func:`~kvedit.states.files.read.load_attached` reads it back.

    Raises:
        InvalidInputError: ``path`` is empty or a directory; ``dtype`` is not float16,
            bfloat16, float32 or float64, or keys and values overflow it.
        StorageError: the file cannot be written (an ``OSError``). An existing file at
            ``path`` is then left as it was, and no temporary file is left.
    """
    return save_file_version(state, path, dtype, attachment=attachment).path


def save_file_version(
    state: StateView,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    *,
    attachment: dict | None = None,
    attached: dict[str, torch.Tensor] | None = None,
) -> SavedFile:
    """:func:`save_state`, returning the version of the file written too (:class:`SavedFile`),
    for a writer that must later tell its own file from another writer's. ``attached``: tensors
    of whoever holds the state (a memory's entry scores), stored as ``attached.NAME``, covered by
    the seal, read back by :func:`~kvedit.states.files.read.read_attached`."""
    path = checks.path(path)
    dtype = checks.save_dtype(dtype)
    seen: set[torch.dtype] = set()
    tensors, params = _state_tensors_and_params(state, dtype, seen)
    for name, t in (attached or {}).items():
        if not isinstance(t, torch.Tensor) or not isinstance(name, str) or not name:
            raise InvalidTypeError(f"attached tensor {name!r} must be a named torch.Tensor")
        tensors[f"{ATTACHED}{name}"] = t.detach().to("cpu").contiguous()
    history = saved_history(state, seen, dtype)
    kv_dtype = dtype if dtype is not None else (min(seen, key=str) if seen else None)
    fields = state_metadata(state, params, history=history, kv_dtype=kv_dtype)
    if attachment is not None:
        if not isinstance(attachment, dict):
            raise InvalidTypeError(f"attachment must be a dict, not {type(attachment).__name__}")
        fields["attachment"] = attachment
    fields["seal"] = make_seal(fields, tensors_digest(tensors))
    meta = {"kvedit": json.dumps(fields, ensure_ascii=False)}
    written: list[tuple[int, int, int, int]] = []

    def write(tmp: str) -> None:
        save_file(tensors, tmp, metadata=meta)
        st = os.stat(tmp)  # the inode renamed onto path: the same device, inode, size, mtime
        written.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    sweep_leftovers(path)  # what a killed save of this file left behind
    return SavedFile(atomic_write(path, write), written[-1])
