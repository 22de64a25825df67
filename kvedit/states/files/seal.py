"""Sealing kvedit's files: a digest of the header and one of the tensors, and a MAC only this
installation can make.

Two threats, two answers:

- **Careless** (a file damaged or edited by hand): the seal holds two BLAKE3 digests, of the
  canonical header (sorted keys, without the ``seal`` entry) and of every tensor's name, dtype,
  shape and bytes in name order. Anyone can recompute them; a mismatch is a
  :class:`~kvedit.errors.CorruptCacheError` naming the file.
- **Hostile** (a file from elsewhere, built to pass): a digest anyone can recompute proves
  nothing about who wrote the file, so the seal also holds ``HMAC-SHA256(key, header digest :
  tensors digest)`` with a per-installation key (:func:`installation_key`). The header alone
  can then be checked without reading a tensor (vLLM's admission reads headers only). A file
  whose MAC this installation can verify is *trusted*: its claims (history, plain capture) are believed. Any other file is
  *foreign*: it loads, with an unknown history, and is never stored or served as a capture.

The key is 32 random bytes in ``$KVEDIT_KEY_FILE``, or ``installation.key`` under
``$XDG_CONFIG_HOME/kvedit`` (``~/.config/kvedit``), made on first write with mode 0600. Machines
that must trust each other's files (a vLLM server reading what a trainer published) share it.

Verifying a file once per version: :class:`VerifiedFiles` remembers the tensors' digest of a
file it has hashed, keyed by ``(device, inode, size, mtime_ns, ctime_ns)``; any write to the file changes
its ``ctime``, which no user can set back, so a remembered file is the file that was hashed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from ...atomic import atomic_write
from ...errors import CorruptCacheError, StorageError

__all__ = [
    "KEY_ENV",
    "VERIFIED",
    "Seal",
    "TensorDigester",
    "VerifiedFiles",
    "check_header",
    "check_tensors",
    "header_bytes",
    "header_digest",
    "installation_key",
    "key_path",
    "make_seal",
    "tensors_digest",
]

KEY_ENV = "KVEDIT_KEY_FILE"
KEY_BYTES = 32
# How many verified file versions a process remembers (a few hundred bytes each).
VERIFIED_MAX = 4096

_key_lock = threading.Lock()


def key_path() -> Path:
    """Where this installation's key lives (:data:`KEY_ENV`, else the XDG config folder)."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvedit" / "installation.key"


def installation_key(create: bool = False) -> bytes | None:
    """This installation's MAC key; ``None`` when there is none yet and ``create`` is False.

    Raises:
        StorageError: the key file exists but is not 32 bytes, or cannot be read or made.
    """
    path = key_path()
    with _key_lock:
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            if not create:
                return None
            key = secrets.token_bytes(KEY_BYTES)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, lambda tmp: _write_private(tmp, key))
            except OSError as e:
                raise StorageError(f"{path}: cannot create the installation key: {e}") from e
            key = path.read_bytes()
        except OSError as e:
            raise StorageError(f"{path}: cannot read the installation key: {e}") from e
    if len(key) != KEY_BYTES:
        raise StorageError(
            f"{path}: the installation key must be {KEY_BYTES} bytes, not {len(key)} "
            f"(remove it to make a new one; files sealed with the old key then load as foreign)"
        )
    return key


def _write_private(tmp: str, key: bytes) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)


def header_bytes(fields: Mapping) -> bytes:
    """The canonical bytes of a header entry, without its ``seal``: what the header digest
    covers."""
    body = {k: v for k, v in fields.items() if k != "seal"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def header_digest(fields: Mapping) -> str:
    """BLAKE3 of :func:`header_bytes` (hex)."""
    return blake3.blake3(header_bytes(fields)).hexdigest()


class TensorDigester:
    """The digest of a file's tensors, fed one tensor at a time in name order: each tensor's
    name, dtype, shape and bytes."""

    def __init__(self) -> None:
        self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        tag = f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}".encode()
        self._hash.update(len(tag).to_bytes(8, "little"))
        self._hash.update(tag)
        if t.numel():
            self._hash.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest of ``tensors`` (:class:`TensorDigester`, in name order)."""
    d = TensorDigester()
    for name in sorted(tensors):
        d.add(name, tensors[name])
    return d.hexdigest()


def _mac(key: bytes, header: str, tensors: str) -> str:
    return hmac.new(key, f"{header}:{tensors}".encode(), hashlib.sha256).hexdigest()


def make_seal(fields: Mapping, body: str) -> dict:
    """The ``seal`` entry of a header: the header's digest, ``body`` (the tensors' digest:
    :func:`tensors_digest`) and this installation's MAC of both (the key is made on first
    use)."""
    head = header_digest(fields)
    return {"header": head, "tensors": body, "mac": _mac(installation_key(create=True), head, body)}


@dataclass(frozen=True)
class Seal:
    """What a file's seal says once checked: the digest of its tensors, and whether this
    installation wrote it (``trusted``: the MAC verifies with this installation's key)."""

    tensors: str
    trusted: bool


def check_header(fields: Mapping, path) -> Seal:
    """Check the header against its seal (cheap: no tensor is read). The returned seal's
    ``tensors`` digest is the recorded one, still to be compared with the tensors
    (:func:`check_tensors`) before they are used.

    Raises:
        CorruptCacheError: no seal, or the header changed since it was sealed.
    """
    seal = fields.get("seal")
    if not isinstance(seal, dict) or not all(
        isinstance(seal.get(k), str) for k in ("header", "tensors")
    ):
        raise CorruptCacheError(f"{path}: no seal in the header (a damaged or hand-made file)")
    mac = seal.get("mac")
    if mac is not None and not isinstance(mac, str):
        raise CorruptCacheError(f"{path}: malformed seal in the header")
    if not hmac.compare_digest(seal["header"], header_digest(fields)):
        raise CorruptCacheError(
            f"{path}: checksum mismatch: the header was edited or damaged after it was written"
        )
    key = installation_key()
    trusted = (
        key is not None
        and mac is not None
        and hmac.compare_digest(mac, _mac(key, seal["header"], seal["tensors"]))
    )
    return Seal(seal["tensors"], trusted)


def check_tensors(seal: Seal, digest: str, path) -> None:
    """The tensors' ``digest`` is the one the seal recorded.

    Raises:
        CorruptCacheError: a tensor changed since the file was sealed.
    """
    if not hmac.compare_digest(seal.tensors, digest):
        raise CorruptCacheError(
            f"{path}: checksum mismatch: the tensors are corrupted or were edited"
        )


class VerifiedFiles:
    """The file versions this process has hashed and found whole (LRU, :data:`VERIFIED_MAX`).

    A version is ``(VerifiedFiles.version(path), recorded tensors digest)``: a file replaced
    by another (a new inode, or a reused inode with new times) or with another recorded digest
    is hashed again.
    """

    def __init__(self, max_entries: int = VERIFIED_MAX) -> None:
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    @staticmethod
    def version(path: str | os.PathLike) -> tuple | None:
        """``(device, inode, size, mtime_ns, ctime_ns)`` of ``path``, or None if unreadable."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def seen(self, key: tuple | None) -> bool:
        """Whether ``key`` was hashed and found whole (None: never)."""
        if key is None:
            return False
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return True
            return False

    def add(self, key: tuple | None) -> None:
        """Remember ``key`` as hashed and whole (None: nothing to remember)."""
        if key is None:
            return
        with self._lock:
            self._seen[key] = None
            self._seen.move_to_end(key)
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


VERIFIED = VerifiedFiles()
"""The process's memory of verified file versions (used by :func:`kvedit.states.files.read.read_sealed`)."""
