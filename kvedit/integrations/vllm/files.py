"""Published caches on disk: one safetensors file per prompt prefix, found by its token ids.

A published cache is ``ROOT/<n>-<sha>.safetensors``: ``n`` the number of prompt tokens it
covers and ``sha`` the first 32 hex digits of the SHA-256 of those token ids (little-endian
int64). Tensors: per layer ``layer.{i}.keys`` and ``layer.{i}.values`` ``[n_i, kv_heads,
head_dim]`` (rows for the last ``n_i`` slots) and ``token_ids`` ``[n]``; the header's
``kvedit`` entry is JSON (format ``kvedit.vllm`` version 1, the token ids, shapes, windows,
fingerprints, the realization report and a CRC-32 of the tensors). Files are written with
:func:`kvedit.atomic.atomic_write` (a reader sees a whole file or none), never pickled.

A lookup (:class:`PublishedIndex`) lists the root's file names once per change of the folder
(and while its last change is under 2 s old) and tries each published length, longest first:
one hash and one ``stat`` per length.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...atomic import atomic_write
from ...errors import CorruptCacheError, InvalidInputError
from ...statefile import crc32_of
from ...storage import read_verified
from .stock import StockCache

FORMAT = "kvedit.vllm"
FORMAT_VERSION = 1
_NAME = re.compile(r"^(\d+)-([0-9a-f]{32})\.safetensors$")


def ids_key(token_ids: list[int]) -> str:
    """The 32-hex-digit key of a token id sequence."""
    data = torch.tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def file_name(token_ids: list[int]) -> str:
    return f"{len(token_ids)}-{ids_key(token_ids)}.safetensors"


def write(cache: StockCache, root: str | os.PathLike, kvedit_version: str) -> Path:
    """Write ``cache`` under ``root`` (created if missing), atomically; returns the path."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidInputError(f"cannot use {root} as the publish root: {e}") from e
    tensors: dict[str, torch.Tensor] = {
        "token_ids": torch.tensor(cache.token_ids, dtype=torch.int64)
    }
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        tensors[f"layer.{i}.keys"] = k.detach().to("cpu").contiguous()
        tensors[f"layer.{i}.values"] = v.detach().to("cpu").contiguous()
    k0 = cache.keys[0]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvedit_version": kvedit_version,
        "token_ids": list(cache.token_ids),
        "n_slots": cache.n_slots,
        "n_layers": len(cache.keys),
        "kv_heads": int(k0.shape[1]),
        "head_dim": int(k0.shape[2]),
        "dtype": str(k0.dtype).removeprefix("torch."),
        "first_slot": [cache.first_slot(i) for i in range(len(cache.keys))],
        "windows": cache.windows,
        "next_position": cache.next_position,
        "shift": cache.shift,
        "exact": cache.exact,
        "null_entries": cache.null_entries,
        "realizations": [
            {**asdict(r), "realized": None if math.isinf(r.realized) else r.realized}
            for r in cache.realizations
        ],
        "model": cache.model,
        "model_fingerprint": cache.model_fingerprint,
        "tokenizer_fingerprint": cache.tokenizer_fingerprint,
        "checksum": crc32_of(tensors),
    }
    header = {"kvedit": json.dumps(meta)}
    path = root / file_name(cache.token_ids)
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))


def read_header(path: str | os.PathLike) -> dict:
    """The JSON metadata of a published file (the header only: no tensor is read).

    Raises:
        CorruptCacheError: not a readable published file of this format version.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["kvedit"])
    except (KeyError, json.JSONDecodeError) as e:
        raise CorruptCacheError(f"{path}: no kvedit metadata in the header") from e
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCacheError(f"{path}: unreadable safetensors file: {e}") from e
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CorruptCacheError(
            f"{path}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT!r} v{FORMAT_VERSION}"
        )
    return meta


def read(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a published file, its CRC verified.

    Raises:
        CorruptCacheError: truncated, corrupted, a pickle, another format.
    """
    return read_verified(path, FORMAT, FORMAT_VERSION, what="published cache format")


class PublishedIndex:
    """Finds the longest published prefix of a prompt under ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._stamp: int | None = None
        self._lengths: list[int] = []

    def lengths(self) -> list[int]:
        """The published prefix lengths, longest first (re-listed when the folder changes)."""
        try:
            stamp = self.root.stat().st_mtime_ns
        except FileNotFoundError:
            return []
        # A folder changed twice within its clock's tick keeps one mtime: list again while
        # the last change is recent.
        if stamp != self._stamp or time.time_ns() - stamp < 2_000_000_000:
            found = {int(m.group(1)) for m in map(_NAME.match, os.listdir(self.root)) if m}
            self._lengths = sorted(found, reverse=True)
            self._stamp = stamp
        return self._lengths

    def lookup(self, prompt_ids: list[int]) -> tuple[Path, int] | None:
        """``(path, n)`` of the longest published cache whose ids start ``prompt_ids``."""
        prompt_ids = list(prompt_ids)
        for n in self.lengths():
            if n > len(prompt_ids) or n == 0:
                continue
            path = self.root / file_name(prompt_ids[:n])
            if path.exists():
                return path, n
        return None
