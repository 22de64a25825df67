"""One served turn's K/V, as vLLM's worker saved them: the hand-off between the connector's save
path and kvedit serve's chat memories.

The worker (:meth:`~kvedit.integrations.vllm.connector.KVEditConnector.wait_for_save`) writes
``ROOT/turns/<turn>.safetensors`` atomically: per layer the keys and values of the tokens vLLM
computed for the turn (``[n, kv_heads, head_dim]``, keys as vLLM rotated them, at vLLM's
positions), the token ids, and the first and last token positions; or ``<turn>.error.json``
saying why nothing was saved. The server process waits for either (:func:`wait_turn`), folds
the turn into the conversation's memory (:mod:`~kvedit.integrations.vllm.conversations`) and
removes it. Nothing here needs vLLM.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...atomic import atomic_write, is_temp_name, left_by_dead_writer, remove_temp
from ...errors import KVEditError

__all__ = [
    "STALE_TURN_SECONDS",
    "TURNS",
    "SavedTurn",
    "remove_turn",
    "sweep_folder",
    "sweep_turns",
    "wait_turn",
    "write_turn",
    "write_turn_error",
]

STALE_TURN_SECONDS = 600.0
"""A saved turn nobody took for this long (its client left) is swept: a turn is taken within
the request that made it."""

TURNS = "turns"
"""The folder under the publish root that saved turns pass through."""

_FORMAT = "kvedit-served-turn"


@dataclass(frozen=True)
class SavedTurn:
    """A turn's K/V as vLLM computed them: tokens ``[start, end)`` of the engine prompt and
    answer (``token_ids``), ``keys``/``values`` per layer ``[n, kv_heads, head_dim]``."""

    turn: str
    start: int
    end: int
    token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def _path(root: str | os.PathLike, turn: str, error: bool = False) -> Path:
    return Path(root) / TURNS / (f"{turn}.error.json" if error else f"{turn}.safetensors")


def write_turn(
    root: str | os.PathLike,
    turn: str,
    start: int,
    token_ids: list[int],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> Path:
    """Write a saved turn (see the module doc), atomically."""
    tensors = {"token_ids": torch.tensor(token_ids, dtype=torch.int64)}
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        tensors[f"layer.{i}.keys"] = k.contiguous()
        tensors[f"layer.{i}.values"] = v.contiguous()
    meta = {"format": _FORMAT, "turn": turn, "start": start, "end": start + len(token_ids)}
    header = {"kvedit": json.dumps({**meta, "n_layers": len(keys)})}
    path = _path(root, turn)
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))


def write_turn_error(root: str | os.PathLike, turn: str, why: str) -> Path:
    """Record that turn ``turn``'s K/V could not be saved, and why."""
    return atomic_write(_path(root, turn, error=True), json.dumps({"turn": turn, "error": why}))


def _read(path: Path, turn: str) -> SavedTurn:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("kvedit", "{}"))
        if meta.get("format") != _FORMAT or meta.get("turn") != turn:
            raise KVEditError(f"{path} is not the saved turn {turn}")
        n = int(meta["n_layers"])
        keys = [f.get_tensor(f"layer.{i}.keys") for i in range(n)]
        values = [f.get_tensor(f"layer.{i}.values") for i in range(n)]
        ids = f.get_tensor("token_ids").tolist()
    if len(ids) != int(meta["end"]) - int(meta["start"]) or any(
        k.shape[0] != len(ids) or v.shape != k.shape for k, v in zip(keys, values, strict=True)
    ):
        raise KVEditError(f"{path}: the saved turn's tensors do not match its tokens")
    return SavedTurn(turn, int(meta["start"]), int(meta["end"]), ids, keys, values)


def wait_turn(root: str | os.PathLike, turn: str, timeout: float) -> SavedTurn:
    """The saved turn ``turn`` once the worker has written it (polling).

    Raises:
        KVEditError: the worker recorded that it could not save the turn (its reason), or
            nothing came within ``timeout`` seconds.
    """
    path, error = _path(root, turn), _path(root, turn, error=True)
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        if path.exists():
            return _read(path, turn)
        if error.exists():
            raise KVEditError(json.loads(error.read_text()).get("error", "not saved"))
        if time.monotonic() > deadline:
            raise KVEditError(f"vLLM's worker saved nothing for turn {turn} in {timeout:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def remove_turn(root: str | os.PathLike, turn: str) -> None:
    """Remove a turn's files once it is folded into its memory (or given up)."""
    for p in (_path(root, turn), _path(root, turn, error=True)):
        p.unlink(missing_ok=True)


def sweep_turns(root: str | os.PathLike, max_age: float = STALE_TURN_SECONDS) -> int:
    """Remove saved turns older than ``max_age`` seconds (a client that left before its answer
    ended) and whatever else is in ``ROOT/turns`` (a killed writer's temporary file or folder,
    anything put there): returns how many entries went. Never raises."""
    return sweep_folder(Path(root) / TURNS, max_age, everything=True)


def sweep_folder(folder: str | os.PathLike, max_age: float, *, everything: bool) -> int:
    """Remove the leftovers in ``folder``: at once, the temporary files and folders
    (:func:`kvedit.atomic.temp_name`) of a writer of this machine no longer running; once older
    than ``max_age`` seconds, any other temporary one and, with ``everything``, any entry
    (files, folders, links). Returns how many entries went; never raises (an entry that cannot
    be removed is left for the next sweep)."""
    now, gone = time.time(), 0
    try:
        entries = list(os.scandir(folder))
    except OSError:  # no folder (yet), or not one: nothing to sweep
        return 0
    for entry in entries:
        temp = is_temp_name(entry.name)
        if not (temp or everything):
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > max_age
        except OSError:
            continue
        if old or (temp and left_by_dead_writer(entry.path)):
            remove_temp(Path(entry.path))
            gone += not os.path.lexists(entry.path)
    return gone
