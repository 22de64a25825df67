"""Projector files: one safetensors file with JSON metadata, no pickles.

Tensors: ``a_inv_freq`` / ``b_inv_freq`` ``[n_layers, head_dim // 2]`` and, per B layer ``i``,
``layer.{i}.weight`` ``[d_in, d_out]`` and ``layer.{i}.bias`` ``[d_out]`` (float32). The
header's ``kvedit`` entry is JSON: :data:`FORMAT`, :data:`FORMAT_VERSION`, the fingerprints of
the model pair, the layer groups, KV shapes, B's windows, the fit ``info`` and a CRC-32 of every
tensor. Written by the one atomic writer (:func:`kvedit.atomic.atomic_write`), read by the
verified reader (:func:`kvedit.states.files.read.read_verified`: header sniffed, format, version and
checksum checked).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from ..atomic import atomic_write
from ..errors import CorruptCacheError
from ..states.files.format import crc32_of
from ..states.files.read import read_verified
from ..version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ProjectorFields",
    "projector_tensors",
    "read_projector",
    "write_projector",
]

FORMAT = "kvedit.projector"
FORMAT_VERSION = 1


class ProjectorFields(Protocol):
    """What a projector file holds, as :class:`~kvedit.project.Projector` has it (see its
    attributes): the writer reads these and nothing else, so it need not import the projector
    (which imports this module)."""

    @property
    def weights(self) -> Sequence[torch.Tensor]: ...

    @property
    def biases(self) -> Sequence[torch.Tensor]: ...

    @property
    def a_layers(self) -> list[list[int]]: ...

    @property
    def a_inv_freq(self) -> torch.Tensor: ...

    @property
    def b_inv_freq(self) -> torch.Tensor: ...

    @property
    def a_kv_shape(self) -> tuple[int, int]: ...

    @property
    def b_kv_shape(self) -> tuple[int, int]: ...

    @property
    def b_windows(self) -> list[int | None]: ...

    @property
    def a_model(self) -> str: ...

    @property
    def a_tokenizer(self) -> str: ...

    @property
    def b_model(self) -> str: ...

    @property
    def b_tokenizer(self) -> str: ...

    @property
    def info(self) -> dict: ...


def projector_tensors(projector: ProjectorFields) -> dict[str, torch.Tensor]:
    """The tensors a projector file holds, float32, contiguous, on CPU."""
    out = {
        "a_inv_freq": projector.a_inv_freq.float().cpu().contiguous(),
        "b_inv_freq": projector.b_inv_freq.float().cpu().contiguous(),
    }
    for i, (w, b) in enumerate(zip(projector.weights, projector.biases, strict=True)):
        out[f"layer.{i}.weight"] = w.float().cpu().contiguous()
        out[f"layer.{i}.bias"] = b.float().cpu().contiguous()
    return out


def write_projector(projector: ProjectorFields, path: str | os.PathLike) -> Path:
    """Write ``projector`` to ``path`` atomically; returns the path.

    Raises:
        InvalidInputError: ``path`` is empty or a directory.
        StorageError: the file could not be written (nothing is left behind).
    """
    tensors = projector_tensors(projector)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvedit_version": __version__,
        "a_model": projector.a_model,
        "a_tokenizer": projector.a_tokenizer,
        "b_model": projector.b_model,
        "b_tokenizer": projector.b_tokenizer,
        "a_layers": projector.a_layers,
        "a_kv_shape": list(projector.a_kv_shape),
        "b_kv_shape": list(projector.b_kv_shape),
        "b_windows": projector.b_windows,
        "info": projector.info,
        "checksum": crc32_of(tensors),
    }
    header = {"kvedit": json.dumps(meta, ensure_ascii=False)}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))


def read_projector(path: str | os.PathLike) -> dict[str, Any]:
    """The :class:`~kvedit.project.Projector` fields stored in a file :func:`write_projector`
    wrote (``Projector(**read_projector(path))``).

    Raises:
        CorruptCacheError: truncated, corrupted, not a projector file, a pickle, or missing a
            tensor or field.
    """
    meta, tensors = read_verified(path, FORMAT, FORMAT_VERSION, what="projector format")
    try:
        n = len(meta["a_layers"])
        return {
            "weights": [tensors[f"layer.{i}.weight"] for i in range(n)],
            "biases": [tensors[f"layer.{i}.bias"] for i in range(n)],
            "a_layers": [list(map(int, g)) for g in meta["a_layers"]],
            "a_inv_freq": tensors["a_inv_freq"],
            "b_inv_freq": tensors["b_inv_freq"],
            "a_kv_shape": tuple(meta["a_kv_shape"]),
            "b_kv_shape": tuple(meta["b_kv_shape"]),
            "b_windows": list(meta["b_windows"]),
            "a_model": meta["a_model"],
            "a_tokenizer": meta["a_tokenizer"],
            "b_model": meta["b_model"],
            "b_tokenizer": meta["b_tokenizer"],
            "info": meta.get("info", {}),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCacheError(f"{path}: projector file lacks tensor or field {e}") from e
