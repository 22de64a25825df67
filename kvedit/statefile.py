"""Writing a KVState file: one safetensors file with JSON metadata in its header.

Layout: per layer ``i``, the tensors its cache-layer class writes (:mod:`kvedit.cache`), named
``layer.{i}.NAME`` (dense: ``keys`` / ``values`` ``[batch, kv_heads, n_i, head_dim]``,
``token_index`` / ``positions`` ``[n_i]``, optional ``bias`` ``[batch, heads, n_i]``; quantized:
packed codes, scales, zero points and the exact residual; merged: norms, retained entries
and the exact tail), ``shared.{key}.NAME`` for data layers share (a merged pair's directions,
written once, named by the layers' ``shared`` param), and ``token_ids``, ``offsets``,
``position_ids``, ``last_logits``. The header's ``kvedit`` entry is JSON: format version,
fingerprints, text, windows, each layer's kind and parameters, and a CRC-32 of every tensor's
bytes. Files are written by :func:`kvedit.atomic.atomic_write`. Reading is
:mod:`kvedit.storage`; this module needs nothing of :mod:`kvedit.state` at run time, so the
state can import it.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from . import checks
from .atomic import atomic_write
from .errors import InvalidInputError

if TYPE_CHECKING:
    from .state import KVState

FORMAT = "kvedit.kvstate"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


def crc32_of(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 over the tensors' names and bytes, in name order (hex)."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(name.encode(), crc)
        if t.numel():
            crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
    return f"{crc:08x}"


def _cast(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    out = t.to("cpu", dtype).contiguous()
    overflow = dtype != t.dtype and out.numel() and not bool(torch.isfinite(out).all())
    if overflow and bool(torch.isfinite(t).all()):
        raise InvalidInputError(
            f"{what} overflow {dtype} (largest |value| {float(t.abs().max()):.4g}); "
            "save them as bfloat16 or float32"
        )
    return out


def state_tensors(state: KVState, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state's tensors by file name, on CPU (K/V cast to ``dtype`` when given).

    Raises:
        InvalidInputError: ``dtype`` is not a float dtype (:func:`kvedit.checks.save_dtype`), or
            keys or values do not fit in it (float16 overflows at 65504).
    """
    return _state_tensors_and_params(state, dtype)[0]


def _state_tensors_and_params(
    state: KVState, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    dtype = checks.save_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    params = []
    written: set[str] = set()
    for i, layer in enumerate(state.layers):

        def cast(t: torch.Tensor, what: str, i: int = i) -> torch.Tensor:
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


def state_metadata(
    state: KVState, tensors: dict[str, torch.Tensor], layer_params: list[dict] | None = None
) -> dict:
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
        "n_tokens": len(state),
        "layer_entries": [len(layer) for layer in state.layers],
        "layer_kinds": [layer.kind for layer in state.layers],
        "layer_params": layer_params or [{} for _ in state.layers],
        "checksum": crc32_of(tensors),
    }


def save_state(state: KVState, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``state`` to ``path`` (see module docstring); ``dtype`` down-casts keys and values.

    Raises:
        InvalidInputError: ``path`` is empty or a directory; ``dtype`` is not float16,
            bfloat16, float32 or float64, or keys and values overflow it.
        StorageError: the file cannot be written (an ``OSError``). An existing file at
            ``path`` is then left as it was, and no temporary file is left.
    """
    path = checks.path(path)
    tensors, params = _state_tensors_and_params(state, dtype)
    meta = {"kvedit": json.dumps(state_metadata(state, tensors, params), ensure_ascii=False)}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
