"""Published caches on disk: one safetensors file per published state, found by its token ids
and named by its digest.

A published cache is ``ROOT/<n>-<ids>-<digest>.safetensors``: ``n`` the number of prompt tokens
it covers, ``ids`` the first 32 hex digits of the SHA-256 of those token ids (little-endian
int64) and ``digest`` the published state's :attr:`~kvedit.KVState.digest` (model fingerprint,
ids and history, an approximation step included; a :class:`StockCache` built by hand gets a
digest of its contents). Two states with the same ids and different digests (a plain capture
and a ``scale_keys`` edit of it) have two files; publishing one state again replaces its own.
Tensors: per layer ``layer.{i}.keys`` and ``layer.{i}.values`` ``[n_i, kv_heads, head_dim]``
(rows for the last ``n_i`` slots) and ``token_ids`` ``[n]``; the header's ``kvedit`` entry is
JSON (format ``kvedit.vllm`` version 3, the token ids, the digest, whether the state was a plain
capture, its history, shapes, windows, fingerprints, the realization report and the seal of
:mod:`kvedit.states.files.seal`: digests of header and tensors and this installation's MAC).
A file whose header was edited is refused as corrupt; a file whose MAC this installation cannot
verify (written elsewhere) is read with ``trusted`` false, and its claims (plain capture,
history) are not believed: it is served only by the digest a request names. Files are written
with :func:`kvedit.atomic.atomic_write` (a reader sees a whole file or none), never pickled.
Files of versions 1 and 2 are not served: publish them again.

A lookup (:class:`PublishedIndex`) lists the root's file names once per change of the folder
(and while its last change is under 2 s old) and tries each published length, longest first:
:meth:`PublishedIndex.find` the file with a given digest (one hash and one ``stat`` per
length), :meth:`PublishedIndex.candidates` every digest published for the longest published
prefix (for a request that names none).

A writer killed mid-write (``kill -9``) leaves its temporary ``.NAME.kvedit-tmp-*`` file or
directory in the root. Writers hold a shared ``flock`` on ``ROOT/.kvedit-publish.lock`` while
they write; the next :func:`write` that gets the lock exclusively (no other writer is alive)
removes every leftover, and otherwise (a writer is running) only those older than
:data:`kvedit.atomic.STALE_TEMP_SECONDS`. Each sweep that removes something logs how many it removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...atomic import STALE_TEMP_SECONDS, atomic_write, is_temp_name, remove_temp
from ...errors import CorruptCacheError, InvalidInputError
from ...states.files.read import read_sealed
from ...states.files.seal import (
    Seal,
    TensorDigester,
    check_header,
    check_tensors,
    make_seal,
    tensors_digest,
)
from .stock import StockCache

FORMAT = "kvedit.vllm"
FORMAT_VERSION = 3
_NAME = re.compile(r"^(\d+)-([0-9a-f]{32})-([0-9a-f]{32})\.safetensors$")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
LOCK_NAME = ".kvedit-publish.lock"

logger = logging.getLogger(__name__)

try:  # POSIX; elsewhere only leftovers older than STALE_TEMP_SECONDS are removed
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


def check_root(root: object) -> Path:
    """``root`` as a Path, refusing an empty one (it would publish into the current folder).

    Raises:
        InvalidInputError: ``root`` is None, empty or blank, or not a path.
    """
    if isinstance(root, bytes):
        root = os.fsdecode(root)
    if not isinstance(root, (str, os.PathLike)):
        raise InvalidInputError(
            f"the publish root must be a folder path (str or os.PathLike), not "
            f"{type(root).__name__}"
        )
    text = os.fspath(root)
    if not str(text).strip():
        raise InvalidInputError(
            "the publish root is empty: give the folder kvedit serve serves (it would be the "
            "current folder)"
        )
    return Path(text)


def sweep(root: str | os.PathLike, *, exclusive: bool, max_age: float = STALE_TEMP_SECONDS) -> int:
    """Remove the temporary files and directories killed writers left in ``root``: all of them
    when ``exclusive`` (no other writer holds the root's lock), else those older than
    ``max_age`` seconds. Returns how many were removed (and logs it when not 0)."""
    root = Path(root)
    now = time.time()
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not is_temp_name(name):
            continue
        path = root / name
        try:
            age = now - path.lstat().st_mtime
        except OSError:
            continue
        if exclusive or age > max_age:
            remove_temp(path)
            removed += not os.path.lexists(path)
    if removed:
        logger.warning(
            "kvedit publish: removed %d temporary file(s) left in %s by killed writers",
            removed,
            root,
        )
    return removed


@contextlib.contextmanager
def _writing(root: Path) -> Iterator[None]:
    """Hold the root's writer lock (shared) while writing, after sweeping leftovers."""
    if fcntl is None:  # pragma: no cover - Windows
        sweep(root, exclusive=False)
        yield
        return
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError:  # a root without a lock file (read-only...): the write itself will tell
        sweep(root, exclusive=False)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            exclusive = True
        except OSError:  # another writer is running: its temporary file is not a leftover
            exclusive = False
        sweep(root, exclusive=exclusive)
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def ids_key(token_ids: list[int]) -> str:
    """The 32-hex-digit key of a token id sequence."""
    data = torch.tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def check_digest(digest: object) -> str:
    """``digest`` if it is a state digest (32 lowercase hex digits), else
    :class:`~kvedit.errors.InvalidInputError`."""
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise InvalidInputError(
            f"a published cache's digest is 32 lowercase hex digits (KVState.digest), not "
            f"{digest!r}"
        )
    return digest


def file_name(token_ids: list[int], digest: str) -> str:
    """The file name of the published state with ``token_ids`` and ``digest``."""
    return f"{len(token_ids)}-{ids_key(token_ids)}-{check_digest(digest)}.safetensors"


def digest_of(path: str | os.PathLike) -> str:
    """The digest a published file is named by.

    Raises:
        InvalidInputError: not a published file's name.
    """
    m = _NAME.match(Path(path).name)
    if m is None:
        raise InvalidInputError(f"{Path(path).name} is not a published cache's file name")
    return m.group(3)


def _cache_digest(cache: StockCache, body: str) -> str:
    """The state's digest, or for a cache built by hand (no digest) one of its contents
    (``body``: the tensors' digest)."""
    if cache.digest:
        return check_digest(cache.digest)
    payload = json.dumps({"ids": list(cache.token_ids), "tensors": body}).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


def write(cache: StockCache, root: str | os.PathLike, kvedit_version: str) -> Path:
    """Write ``cache`` under ``root`` (created if missing), atomically; returns the path."""
    root = check_root(root)
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
    body = tensors_digest(tensors)
    digest = _cache_digest(cache, body)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvedit_version": kvedit_version,
        "token_ids": list(cache.token_ids),
        "digest": digest,
        "plain_capture": cache.plain_capture,
        "history": cache.history.to_json() if cache.history is not None else None,
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
    }
    meta["seal"] = make_seal(meta, body)
    header = {"kvedit": json.dumps(meta)}
    path = root / file_name(cache.token_ids, digest)
    with _writing(root):
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))


def read_header(path: str | os.PathLike) -> dict:
    """The JSON metadata of a published file (the header only: no tensor is read), its seal's
    header digest checked; ``trusted`` added: whether this installation wrote the file (only
    then are its claims, ``plain_capture`` and ``history``, to be believed).

    Raises:
        CorruptCacheError: not a readable published file of this format version, or a header
            edited after it was written.
    """
    meta, seal = _sealed_header(path)
    return {**meta, "trusted": seal.trusted}


def _sealed_header(path: str | os.PathLike) -> tuple[dict, Seal]:
    """The header entry of a published file as written, and its checked seal."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["kvedit"])
    except (KeyError, json.JSONDecodeError) as e:
        raise CorruptCacheError(f"{path}: no kvedit metadata in the header") from e
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCacheError(f"{path}: unreadable safetensors file: {e}") from e
    if not isinstance(meta, dict):
        raise CorruptCacheError(f"{path}: the kvedit metadata is not a JSON object")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CorruptCacheError(
            f"{path}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT!r} v{FORMAT_VERSION}"
        )
    return meta, check_header(meta, path)


def verify(path: str | os.PathLike) -> dict:
    """The header of a published file (:func:`read_header`) whose tensors match its seal,
    read one tensor at a time (a file's largest tensor in memory, not the whole file).

    Raises:
        CorruptCacheError: truncated, corrupted, edited, another format.
        FileNotFoundError: no such file.
    """
    meta, seal = _sealed_header(path)
    digester = TensorDigester()
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):  # noqa: SIM118
                digester.add(name, f.get_tensor(name))
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCacheError(f"{path}: unreadable safetensors file: {e}") from e
    check_tensors(seal, digester.hexdigest(), path)
    return {**meta, "trusted": seal.trusted}


def read(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a published file, its seal verified; the metadata has
    ``trusted`` as :func:`read_header` adds it.

    Raises:
        CorruptCacheError: truncated, corrupted, edited, a pickle, another format.
    """
    found = read_sealed(path, FORMAT, FORMAT_VERSION, what="published cache format", sealed_from=3)
    return {**found.meta, "trusted": found.trusted}, found.tensors


class PublishedIndex:
    """Finds the published caches whose ids start a prompt, under ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._stamp: int | None = None
        self._names: dict[int, dict[str, list[str]]] = {}

    def _listing(self) -> dict[int, dict[str, list[str]]]:
        """``{length: {ids key: [digests]}}`` of the published files (re-listed when the folder
        changes)."""
        try:
            stamp = self.root.stat().st_mtime_ns
        except FileNotFoundError:
            return {}
        # A folder changed twice within its clock's tick keeps one mtime: list again while
        # the last change is recent.
        if stamp != self._stamp or time.time_ns() - stamp < 2_000_000_000:
            found: dict[int, dict[str, list[str]]] = {}
            for m in map(_NAME.match, sorted(os.listdir(self.root))):
                if m:
                    found.setdefault(int(m.group(1)), {}).setdefault(m.group(2), []).append(
                        m.group(3)
                    )
            self._names = found
            self._stamp = stamp
        return self._names

    def lengths(self) -> list[int]:
        """The published prefix lengths, longest first."""
        return sorted(self._listing(), reverse=True)

    def _prefixes(self, prompt_ids: list[int]) -> Iterator[tuple[int, list[int]]]:
        for n in self.lengths():
            if 0 < n <= len(prompt_ids):
                yield n, prompt_ids[:n]

    def find(self, prompt_ids: list[int], digest: str) -> tuple[Path, int] | None:
        """``(path, n)`` of the published cache with ``digest`` whose ids start ``prompt_ids``
        (the longest, should one digest be published for several lengths), or None."""
        prompt_ids = list(prompt_ids)
        for n, ids in self._prefixes(prompt_ids):
            path = self.root / file_name(ids, digest)
            if path.exists():
                return path, n
        return None

    def with_digest(self, digest: str) -> list[tuple[Path, int]]:
        """``[(path, n)]``: every published file named by ``digest`` (whatever its ids)."""
        return [
            (self.root / f"{n}-{key}-{digest}.safetensors", n)
            for n, keys in self._listing().items()
            for key, digests in keys.items()
            if digest in digests
        ]

    def candidates(self, prompt_ids: list[int]) -> tuple[int, dict[str, Path]] | None:
        """``(n, {digest: path})``: the longest published prefix of ``prompt_ids`` and every
        file published for it (one per digest), or None."""
        return next(self.prefixes(prompt_ids), None)

    def prefixes(self, prompt_ids: list[int]) -> Iterator[tuple[int, dict[str, Path]]]:
        """``(n, {digest: path})`` for every published prefix of ``prompt_ids``, longest
        first: the files published for it (one per digest)."""
        prompt_ids = list(prompt_ids)
        listing = self._listing()
        for n, ids in self._prefixes(prompt_ids):
            key = ids_key(ids)
            paths = {d: self.root / f"{n}-{key}-{d}.safetensors" for d in listing[n].get(key, [])}
            paths = {d: p for d, p in paths.items() if p.exists()}
            if paths:
                yield n, paths
