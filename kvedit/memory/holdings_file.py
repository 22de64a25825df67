"""A memory file (:meth:`kvedit.Memory.save`'s) read without its model: :func:`read_held_file`.

The file is read and verified as any state file is (:func:`kvedit.states.files.read.read_state_file`:
its header, format and version, and its seal over header and tensors, so a torn or edited file
is refused), then its attachment's fields are checked as :meth:`kvedit.Memory.load` checks them
(:func:`kvedit.memory.attached.check_fields`), except the one check that needs the tokenizer:
that the messages rendered again give the file's token ids. Here the turns must tile the
file's tokens in order instead (what a load checks of a file this installation sealed). The
layers are built on the CPU in the dtype their keys and values were written in, so their bytes
are the file's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import layer_class
from ..errors import CorruptCacheError, InvalidInputError
from ..states.files.read import read_state_file
from .attached import ATTACHMENT_KIND, check_fields
from .forgetting import Round
from .holdings import MessageHeld, held_by_message
from .records import Turn
from .rendering import Message

__all__ = ["HeldFile", "read_held_file"]


@dataclass(frozen=True)
class HeldFile:
    """What a memory file holds, read without the model: the ``model`` that made it (its
    header's name, None where it records none), its ``prompt`` format, ``messages``, their
    ``turns``, the forgetting ``rounds``, the ``Memory`` ``keywords`` of its budget (empty:
    none), its cache ``layers`` and their ``windows``, its ``n_tokens``, and whether this
    installation sealed it (``trusted``)."""

    path: Path
    model: str | None
    prompt: str
    messages: list[Message]
    turns: list[Turn]
    rounds: list[Round]
    keywords: dict
    layers: list
    n_tokens: int
    trusted: bool

    @property
    def counted_layers(self) -> tuple[int, ...]:
        """The global-attention layers (every layer when every layer slides), as
        :attr:`kvedit.KVState.counted_layers`."""
        found = tuple(i for i, layer in enumerate(self.layers) if layer.window is None)
        return found or tuple(range(len(self.layers)))

    @property
    def nbytes(self) -> int:
        """Bytes the cache's layers hold, as written (every layer)."""
        return sum(layer.nbytes for layer in self.layers)

    def entries(self) -> list[float]:
        """The entries each counted layer holds (per KV head, on average over its heads)."""
        return [
            self.layers[i].head_entries() / max(self.layers[i].kv_shape[1], 1)
            for i in self.counted_layers
        ]

    def held(self) -> list[MessageHeld]:
        """Per message and per counted layer, what is kept, quantized and forgotten
        (:func:`kvedit.memory.holdings.held_by_message`)."""
        return held_by_message(self.turns, self.layers, self.counted_layers, self.n_tokens)


def read_held_file(path: str | os.PathLike) -> HeldFile:
    """The memory file at ``path``, verified and checked without the model (module docstring).

    Raises:
        InvalidInputError: no file at ``path``, or a folder.
        CorruptCacheError: not a kvedit state file, torn or edited (its seal), not a memory,
            or a field that is not what :meth:`kvedit.Memory.save` writes.
    """
    path = Path(path)
    if not path.exists():
        raise InvalidInputError(f"{path}: no such memory file (Memory.save writes one)")
    if path.is_dir():
        raise InvalidInputError(f"{path} is a folder, not a memory file")
    found = read_state_file(path)
    meta, tensors = found.meta, found.tensors
    attachment = meta.get("attachment")
    if not isinstance(attachment, dict) or attachment.get("kind") != ATTACHMENT_KIND:
        raise CorruptCacheError(f"{path}: a state file, not a memory (Memory.save writes one)")
    token_ids = tensors.get("token_ids")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        raise CorruptCacheError(f"{path}: the state file holds no token ids")
    n_tokens = int(token_ids.shape[0])
    fields = check_fields(attachment, path, n_tokens)
    model = meta.get("model")
    return HeldFile(
        path=path,
        model=model if isinstance(model, str) and model else None,
        prompt=fields.prompt,
        messages=fields.messages,
        turns=fields.turns,
        rounds=fields.rounds,
        keywords=fields.keywords,
        layers=_layers(meta, tensors, path),
        n_tokens=n_tokens,
        trusted=found.trusted,
    )


def _kv_dtype(meta: dict, path: Path) -> torch.dtype:
    """The dtype the file's keys and values were written in (float32 where it records none)."""
    name = meta.get("kv_dtype") or "float32"
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CorruptCacheError(f"{path}: kv_dtype {name!r} in the metadata is not a float dtype")
    return dtype


def _layers(meta: dict, tensors: dict, path: Path) -> list:
    """The file's cache layers on the CPU (each by its kind's class, as a load builds them)."""
    windows, dtype = meta.get("windows"), _kv_dtype(meta, path)
    if not isinstance(windows, list) or not windows:
        raise CorruptCacheError(f"{path}: the metadata lists no layers")
    kinds = meta.get("layer_kinds") or ["dense"] * len(windows)
    params = meta.get("layer_params") or [{} for _ in windows]
    if len(kinds) != len(windows) or len(params) != len(windows):
        raise CorruptCacheError(f"{path}: {len(kinds)} layer kinds for {len(windows)} layers")
    layers, cpu = [], torch.device("cpu")
    try:
        for i, (window, kind, layer_params) in enumerate(zip(windows, kinds, params, strict=True)):
            prefix = f"layer.{i}."
            mine = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
            shared = layer_params.get("shared") if isinstance(layer_params, dict) else None
            if shared is not None:  # data the layer shares with others, written once
                block = f"shared.{shared}."
                mine.update(
                    {
                        f"shared.{k[len(block) :]}": t
                        for k, t in tensors.items()
                        if k.startswith(block)
                    }
                )
            layers.append(layer_class(kind).from_tensors(mine, layer_params, window, cpu, dtype))
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CorruptCacheError(f"{path}: state file has a malformed layer: {e}") from None
    return layers
