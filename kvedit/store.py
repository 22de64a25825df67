"""KVStore: a content-addressed, two-tier store of captured states, for prefix reuse and blending.

Keys. A state is stored under the hash of its model and tokenizer fingerprints and its token
ids, computed in chunks of ``chunk_tokens`` (256) ids with chained hashes, as LMCache does::

    h_0     = H("kvedit.store/1", model fingerprint, tokenizer fingerprint)
    h_{j+1} = H(h_j, ids of chunk j)                       (chunk j = ids[256 j : 256 (j + 1)])
    key     = h_m if n == 256 m, else H(h_m, ids[256 m : n])         (m = n // 256)

Every entry is indexed under the chain hashes of its full chunks, so the longest stored prefix
of a new prompt is found by hashing the prompt's chunks: an entry whose ids are all a prefix of
the prompt is used whole; otherwise an entry that shares the prompt's first ``j`` chunks is cut
to ``256 j`` tokens (:meth:`KVStore.longest_prefix`). Passages (texts cached on their own, see
:func:`~kvedit.reuse.capture_passage`) are entries like any other, keyed by their ids, which is
what :func:`~kvedit.blend` looks them up by.

Unlike LMCache, an entry is one whole state (one file), not one file per chunk: two entries
with a common prefix both hold it (no deduplication), in exchange for one file per entry, simple
eviction and pinning, and no chain of chunk files to keep consistent. A state of a model with
sliding-window layers (Gemma-3) holds only the last ``window - 1`` tokens in those layers, so it
can be used whole but not cut at an earlier chunk boundary.

Tiers. Entries live on disk under ``root`` (LRU by bytes up to ``max_bytes``); an optional
in-memory tier in front (LRU up to ``memory_bytes``) keeps recently used states ready. ``pin``
keeps an entry in both tiers and exempts it from expiry; ``put(..., ttl=s)`` makes it expire
after ``s`` seconds.

Disk layout and safety::

    root/store.json          format version and chunk size
    root/.lock               fcntl lock serialising writers (put, evict, pin, recovery)
    root/entries/KEY.kv      the state: safetensors, JSON header, CRC-32 (kvedit.storage)
    root/entries/KEY.json    the entry's index record: token count, chunk hashes, pin, expiry

Both files are written by :func:`kvedit.atomic.atomic_write` (a temporary name
``.NAME.kvedit-tmp-*``, fsync, rename), the ``.kv`` first: an entry exists once its ``.json``
does. Writers hold the lock while they write, so several writers (in threads or processes) are
serialised, never interleaved, and a temporary file seen by a holder of the lock belongs to a
writer that died. Readers take no lock: a rename is atomic and an open file survives deletion.
Opening a store recovers from a writer killed mid-write: temporary files are removed (kvedit's
own, and the ``.*.tmp`` and ``.tmpXXXXXX`` files of kvedit 0.1 and safetensors), a ``.kv``
without ``.json`` gets its record rebuilt from the file (or is removed if it does not verify),
a ``.json`` without ``.kv`` is removed; every write sweeps temporary files again. Until then,
whatever the entries directory holds (records and leftovers included) counts against
``max_bytes`` and shows in :meth:`KVStore.stats`. A store whose directory was deleted
recreates it on the next write. The index is rebuilt from the ``.json`` records whenever the
directory changes. A corrupt entry fails its checksum
(:class:`~kvedit.errors.CorruptCacheError`) when read, and is dropped, never served. Nothing is
ever pickled. Locking uses ``fcntl`` (POSIX).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from . import checks
from .atomic import atomic_write, is_temp_name
from .errors import (
    CacheMismatchError,
    CorruptCacheError,
    EntryNotFoundError,
    InvalidInputError,
    InvalidTypeError,
    StoreLockTimeout,
    StoreUnavailableError,
)
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .reuse import cut_layers, encode, extend_ids
from .state import KVState, LayerKV
from .storage import (
    read_state_file,
    save_state,
    state_from_parts,
)

CHUNK_TOKENS = 256
STORE_FORMAT = "kvedit.store"
STORE_VERSION = 1
_KEY = re.compile(r"[0-9a-f]{32}")
_HASH_LEN = 32
# A directory listing made this soon after the directory's mtime may miss a write made in the
# same timestamp tick; such a listing is redone on the next lookup.
_RACY_SECONDS = 1.0
# Temporary files of older writers: kvedit 0.1's ``.NAME.XXXXXXXX.tmp`` and safetensors'
# ``.tmpXXXXXX`` (safetensors writes beside its target, then renames).
_OLD_TEMP = re.compile(r"\..+\.tmp|\.tmp[A-Za-z0-9_]{6}")

__all__ = [
    "CHUNK_TOKENS",
    "EntryMeta",
    "KVStore",
    "PrefixMatch",
    "StoreLockTimeout",
    "chain_root",
    "chunk_hashes",
    "content_key",
    "tail_key",
]


def _is_leftover(name: str) -> bool:
    """Whether a file name is a temporary file some writer left (never an entry or record)."""
    return is_temp_name(name) or bool(_OLD_TEMP.fullmatch(name))


# -------------------------------------------------------------------- content keys


def _h(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:_HASH_LEN]


def _id_bytes(ids: Sequence[int]) -> bytes:
    return torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()


def chain_root(model_fp: str, tokenizer_fp: str) -> str:
    """``h_0``: the hash every key of one model and tokenizer chains from."""
    return _h(f"{STORE_FORMAT}/{STORE_VERSION}".encode(), model_fp.encode(), tokenizer_fp.encode())


def chunk_hashes(root: str, ids: Sequence[int], chunk: int) -> list[str]:
    """``[h_0, h_1, ..., h_m]``: the chain hashes at every full-chunk boundary of ``ids``."""
    out = [root]
    for start in range(0, len(ids) - chunk + 1, chunk):
        out.append(_h(out[-1].encode(), _id_bytes(ids[start : start + chunk])))
    return out


def tail_key(chain: str, tail: Sequence[int]) -> str:
    """The key of ids ending in a partial chunk ``tail`` after the chain hash ``chain``."""
    return chain if not tail else _h(chain.encode(), _id_bytes(tail))


def content_key(model_fp: str, tokenizer_fp: str, ids: Sequence[int], chunk: int) -> str:
    """The store key of a state of ``ids`` made by the given model and tokenizer."""
    hashes = chunk_hashes(chain_root(model_fp, tokenizer_fp), ids, chunk)
    return tail_key(hashes[-1], ids[(len(hashes) - 1) * chunk :])


# The tokenizer fingerprint is memoised per tokenizer in kvedit.fingerprint now; this name stays
# for modules that imported the store's own memo.
_tokenizer_fp = tokenizer_fingerprint


# -------------------------------------------------------------------- entry records


@dataclass(frozen=True)
class EntryMeta:
    """The index record of one entry (``KEY.json``).

    Attributes:
        key: the content key.
        n_tokens: number of tokens of the stored state.
        model_fingerprint, tokenizer_fingerprint: who made it.
        chunk_hashes: ``[h_1 .. h_m]``, the chain hashes of its full chunks.
        cuttable: whether the state can be cut at an earlier chunk boundary (every layer holds
            every token it would need).
        file_bytes: size of the ``.kv`` file (0 for an entry only in memory).
        created: unix time of the first put.
        expires: unix time after which the entry is not served (None: never).
        pinned: pinned entries are never evicted and never expire.
    """

    key: str
    n_tokens: int
    model_fingerprint: str
    tokenizer_fingerprint: str
    chunk_hashes: tuple[str, ...]
    cuttable: bool
    file_bytes: int
    created: float
    expires: float | None = None
    pinned: bool = False

    def expired(self, now: float) -> bool:
        return not self.pinned and self.expires is not None and now >= self.expires

    def levels(self) -> list[str]:
        """``[h_0, h_1, ..., h_m]``: the chain hashes this entry is indexed under."""
        return [chain_root(self.model_fingerprint, self.tokenizer_fingerprint), *self.chunk_hashes]

    def to_json(self) -> str:
        return json.dumps({"format": f"{STORE_FORMAT}.entry", **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EntryMeta:
        """Parse a record; raises ValueError on anything malformed."""
        try:
            data = json.loads(text)
            if data.pop("format") != f"{STORE_FORMAT}.entry":
                raise ValueError("not a kvedit store entry record")
            data["chunk_hashes"] = tuple(data["chunk_hashes"])
            meta = cls(**data)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed entry record: {e}") from e
        if not _KEY.fullmatch(meta.key) or meta.n_tokens <= 0:
            raise ValueError("malformed entry record")
        return meta


@dataclass
class PrefixMatch:
    """A stored prefix of a prompt (:meth:`KVStore.longest_prefix_ids`).

    Attributes:
        state: the prefix's state (its first ``n_tokens`` prompt tokens), or None.
        n_tokens: number of prompt tokens it covers (0 when nothing matched).
        key: key of the stored entry it came from.
        source: ``"memory"`` or ``"disk"``.
    """

    state: KVState | None
    n_tokens: int = 0
    key: str | None = None
    source: str | None = None


@dataclass
class _MemoryEntry:
    state: KVState  # without model/tokenizer attached
    meta: EntryMeta
    nbytes: int


def _check_storable(state: KVState) -> None:
    """Only unedited captures are content-addressed: the key says nothing about edits."""
    n = len(state)
    problems = []
    if state.next_position != n or not torch.equal(state.position_ids, torch.arange(n)):
        problems.append("positions are not 0..n-1")
    for i, layer in enumerate(state.layers):
        if type(layer) is not LayerKV:
            problems.append(f"layer {i} is a {type(layer).__name__}")
            break
        tail = torch.arange(n - len(layer), n)
        if layer.bias is not None:
            problems.append(f"layer {i} has a bias")
        elif not (torch.equal(layer.token_index, tail) and torch.equal(layer.positions, tail)):
            problems.append(f"layer {i} entries are not one per token in order")
        elif layer.window is None and len(layer) != n:
            problems.append(f"global layer {i} does not hold every token")
        if problems:
            break
    if problems:
        raise InvalidInputError(
            "KVStore holds unedited captures only (an edited cache is not determined by its "
            f"tokens, so it cannot be content-addressed): {problems[0]}"
        )


# -------------------------------------------------------------------- the store


class KVStore:
    """A content-addressed store of KV states with a disk tier and an optional memory tier.

    Args:
        root: directory of the disk tier (created if missing).
        max_bytes: disk budget; least recently used unpinned entries are evicted beyond it
            (None: unbounded). An entry larger than what unpinned space allows is not written.
        memory_bytes: budget of the in-memory tier (None or 0: no memory tier).
        chunk_tokens: ids per hashed chunk (default 256); fixed when the store is created.
        lock_timeout: seconds a writer waits for another writer's lock before
            :class:`StoreLockTimeout`.

    Counters in :meth:`stats` (hits, misses, evictions...) are per ``KVStore`` object.

    Raises:
        InvalidInputError: a negative budget, ``chunk_tokens < 1``, a negative or non-finite
            ``lock_timeout`` (:class:`~kvedit.errors.InvalidTypeError` for a wrong type).
        StoreUnavailableError: ``root`` cannot be created (an ``OSError``).
        CorruptCacheError: ``root/store.json`` is not a kvedit store configuration.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        max_bytes: int | None = None,
        memory_bytes: int | None = None,
        *,
        chunk_tokens: int | None = None,
        lock_timeout: float = 60.0,
    ):
        if max_bytes is not None:
            max_bytes = checks.count("max_bytes", max_bytes, minimum=0)
        if memory_bytes is not None:
            memory_bytes = checks.count("memory_bytes", memory_bytes, minimum=0)
        if chunk_tokens is not None:
            chunk_tokens = checks.count("chunk_tokens", chunk_tokens, minimum=1)
        lock_timeout = checks.real("lock_timeout", lock_timeout)
        if lock_timeout < 0:
            raise InvalidInputError(f"lock_timeout must be >= 0 seconds, not {lock_timeout}")
        if isinstance(root, bytes):
            root = os.fsdecode(root)
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise InvalidTypeError(f"root must be a directory path, not {root!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.memory_bytes = memory_bytes or 0
        self.lock_timeout = lock_timeout
        self._entries = self.root / "entries"
        self._make_dirs()
        self._mutex = threading.RLock()
        self._memory: OrderedDict[str, _MemoryEntry] = OrderedDict()
        self._index: dict[str, EntryMeta] = {}
        self._by_level: dict[str, set[str]] = {}
        self._index_stamp: tuple | None = None
        self._sizes: dict[str, int] = {}  # key -> bytes of its .kv and .json
        self._disk_bytes = 0  # everything in the entries directory
        self._stray: tuple[int, int] = (0, 0)  # (files, bytes) left by dead writers
        self._counts: Counter = Counter()
        self._held = threading.local()
        with self._write_lock():
            self.chunk_tokens = self._init_config(chunk_tokens)
            self._recover()
            self._evict_disk()

    # ---------------------------------------------------------------- public API

    def key_for(self, model: PreTrainedModel, tokenizer, ids: Sequence[int]) -> str:
        """The key a state of token ``ids`` made by ``model``/``tokenizer`` is stored under."""
        mfp, tfp = self._fingerprints(model, tokenizer)
        return content_key(mfp, tfp, [int(i) for i in ids], self.chunk_tokens)

    def put(self, state: KVState, ttl: float | None = None) -> str:
        """Store ``state`` (an unedited capture) and return its key (hex).

        ``ttl``: seconds until the entry expires (None: never); putting an existing key again
        refreshes it and sets its TTL anew. Raises
        :class:`~kvedit.errors.InvalidInputError` (a ValueError) for edited states (a bias,
        added or moved entries, quantized layers). The store trusts that the state is what a
        prefill of its tokens gives: a blended state (an approximation) put here would be
        reused as if exact. The memory tier keeps a reference to ``state`` (states are never
        mutated by kvedit).
        """
        if not isinstance(state, KVState):
            raise InvalidTypeError(f"put takes a KVState, not a {type(state).__name__}")
        if ttl is not None:
            ttl = checks.real("ttl", ttl)
            if not ttl > 0:
                raise InvalidInputError(
                    f"ttl must be a positive number of seconds or None, not {ttl!r}"
                )
        _check_storable(state)
        ids = state.token_ids.tolist()
        root = chain_root(state.model_fingerprint, state.tokenizer_fingerprint)
        hashes = chunk_hashes(root, ids, self.chunk_tokens)
        key = tail_key(hashes[-1], ids[(len(hashes) - 1) * self.chunk_tokens :])
        now = time.time()
        meta = EntryMeta(
            key=key,
            n_tokens=len(ids),
            model_fingerprint=state.model_fingerprint,
            tokenizer_fingerprint=state.tokenizer_fingerprint,
            chunk_hashes=tuple(hashes[1:]),
            cuttable=all(len(layer) == len(ids) for layer in state.layers),
            file_bytes=0,
            created=now,
            expires=None if ttl is None else now + ttl,
        )
        with self._write_lock():
            meta = self._put_disk(state, meta)
        self._remember(key, state, meta)
        self._counts["puts"] += 1
        return key

    def get(self, key: str, model: PreTrainedModel, tokenizer) -> KVState | None:
        """The stored state under ``key``, bound to ``model``/``tokenizer``, or None.

        Expired, missing and corrupt entries give None (a corrupt one is dropped). Raises
        :class:`~kvedit.errors.CacheMismatchError` if the entry was made by another model.
        """
        state, _ = self.fetch(_check_key(key), model, tokenizer)
        return state

    def fetch(self, key: str, model: PreTrainedModel, tokenizer) -> tuple[KVState | None, str]:
        """Like :meth:`get`, also saying where the state came from: ``"memory"``, ``"disk"``
        or ``"miss"``."""
        key = _check_key(key)
        fps = self._fingerprints(model, tokenizer)
        state = self._from_memory(key, fps, model, tokenizer)
        if state is not None:
            self._counts["hits_memory"] += 1
            return state, "memory"
        state = self._from_disk(key, fps, model, tokenizer)
        if state is not None:
            self._counts["hits_disk"] += 1
            return state, "disk"
        self._counts["misses"] += 1
        return None, "miss"

    def longest_prefix(
        self, model: PreTrainedModel, tokenizer, text: str
    ) -> tuple[KVState | None, int]:
        """The state of the longest stored prefix of ``text``'s tokens, and its token count.

        ``text`` is tokenized as :func:`~kvedit.capture` does. The prefix is a whole stored
        entry whose ids begin the prompt's, or an entry cut at a chunk boundary the prompt
        shares (its last token is then recomputed, for its logits). ``(None, 0)`` if none.
        """
        ids, offsets = encode(tokenizer, text)
        match = self.longest_prefix_ids(model, tokenizer, ids, offsets, text)
        return match.state, match.n_tokens

    def longest_prefix_ids(
        self,
        model: PreTrainedModel,
        tokenizer,
        ids: Sequence[int],
        offsets: torch.Tensor,
        text: str,
    ) -> PrefixMatch:
        """:meth:`longest_prefix` for an already tokenized prompt (``offsets [n, 2]`` into
        ``text``); the returned state's text and offsets are the prompt's."""
        ids = [int(i) for i in ids]
        mfp, tfp = self._fingerprints(model, tokenizer)
        hashes = chunk_hashes(chain_root(mfp, tfp), ids, self.chunk_tokens)
        for key, n in self._candidates(hashes, ids):
            stored, source = self.fetch(key, model, tokenizer)
            if stored is None:
                continue
            state = self._as_prefix(stored, n, ids, offsets, text)
            return PrefixMatch(state, n, key, source)
        return PrefixMatch(None)

    def pin(self, key: str) -> None:
        """Keep ``key`` in both tiers and never let it expire, until :meth:`unpin`."""
        self._set_pinned(_check_key(key), True)

    def unpin(self, key: str) -> None:
        """Make ``key`` evictable again (and subject to its TTL, if it has one)."""
        self._set_pinned(_check_key(key), False)

    def evict(self, key: str) -> bool:
        """Remove ``key`` from both tiers (pinned or not). Returns whether it was stored."""
        key = _check_key(key)
        with self._mutex:
            in_memory = self._memory.pop(key, None) is not None
        with self._write_lock():
            on_disk = self._delete_files(key)
        return in_memory or on_disk

    def stats(self) -> dict:
        """Sizes of both tiers and this object's counters (hits, misses, evictions, ...).

        ``bytes`` is everything the entries directory holds: entries, their records, and
        ``stray_bytes`` in ``stray_files`` left by writers that died (removed by the next
        write or open); it is what ``max_bytes`` bounds.
        """
        index = self._refresh_index()
        with self._mutex:
            memory = list(self._memory.values())
        out = {
            "entries": len(index),
            "bytes": self._disk_bytes,
            "stray_files": self._stray[0],
            "stray_bytes": self._stray[1],
            "pinned": sum(m.pinned for m in index.values()),
            "memory_entries": len(memory),
            "memory_bytes": sum(e.nbytes for e in memory),
            "max_bytes": self.max_bytes,
            "memory_limit": self.memory_bytes or None,
            "chunk_tokens": self.chunk_tokens,
        }
        for name in (
            "puts",
            "hits_memory",
            "hits_disk",
            "misses",
            "evictions",
            "expired",
            "corrupt",
            "rejected",
        ):
            out[name] = self._counts[name]
        return out

    def __repr__(self) -> str:
        return (
            f"KVStore({str(self.root)!r}, max_bytes={self.max_bytes}, "
            f"memory_bytes={self.memory_bytes or None})"
        )

    # ---------------------------------------------------------------- locking and set-up

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        """Exclusive across threads and processes: an ``fcntl.flock`` on ``root/.lock``, taken
        through a new file descriptor per holder (so threads exclude each other too), and
        re-entrant within a thread."""
        if getattr(self._held, "depth", 0):
            self._held.depth += 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        fd = self._open_lock()
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreLockTimeout(
                            f"{self.root}: another writer held the store lock for more than "
                            f"{self.lock_timeout}s (lock file {self.root / '.lock'})"
                        ) from None
                    time.sleep(0.005)
            self._held.depth = 1
            try:
                if hasattr(self, "chunk_tokens") and not (self.root / "store.json").exists():
                    self._init_config(self.chunk_tokens)  # the directory was deleted meanwhile
                yield
            finally:
                self._held.depth = 0
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _make_dirs(self) -> None:
        try:
            self._entries.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailableError(
                f"{self.root}: cannot create the store's directory: {e.strerror or e}"
            ) from e

    def _open_lock(self) -> int:
        """A new descriptor of ``root/.lock``; recreates the directories if they were deleted."""
        lock = self.root / ".lock"
        try:
            return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            self._make_dirs()
            self._index_stamp = None
        try:
            return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreUnavailableError(
                f"{self.root}: cannot open the store's lock file: {e.strerror or e}"
            ) from e

    def _init_config(self, chunk_tokens: int | None) -> int:
        path = self.root / "store.json"
        if path.exists():
            try:
                config = json.loads(path.read_text())
                stored = int(config["chunk_tokens"])
                if config.get("format") != STORE_FORMAT or config.get("version") != STORE_VERSION:
                    raise ValueError
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptCacheError(f"{path}: not a kvedit store configuration") from e
            if chunk_tokens is not None and chunk_tokens != stored:
                raise InvalidInputError(
                    f"{self.root} was created with chunk_tokens={stored}, not {chunk_tokens}"
                )
            return stored
        chunk = chunk_tokens or CHUNK_TOKENS
        config = {"format": STORE_FORMAT, "version": STORE_VERSION, "chunk_tokens": chunk}
        self._make_dirs()
        atomic_write(path, json.dumps(config))
        return chunk

    def _sweep_leftovers(self) -> None:
        """Remove the temporary files of writers that died (lock held: every live writer holds
        the lock while its temporary file exists, so none seen now is in use)."""
        removed = False
        for folder in (self.root, self._entries):
            try:
                names = os.listdir(folder)
            except FileNotFoundError:
                continue
            for name in names:
                if not _is_leftover(name):
                    continue
                path = folder / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed = True
        if removed:
            self._index_stamp = None

    def _recover(self) -> None:
        """Bring the disk tier back to a consistent state after a writer died (lock held)."""
        self._sweep_leftovers()
        kv = {p.stem for p in self._entries.glob("*.kv")}
        records = {p.stem for p in self._entries.glob("*.json")}
        for key in records - kv:
            (self._entries / f"{key}.json").unlink(missing_ok=True)
        for key in sorted(kv):
            record = self._read_record(key)
            if record is None:
                self._rebuild_record(key)

    def _rebuild_record(self, key: str) -> None:
        """Write the ``.json`` of a ``.kv`` left without one, or remove the ``.kv`` if bad."""
        path = self._entries / f"{key}.kv"
        try:
            if not _KEY.fullmatch(key):
                raise CorruptCacheError(f"{path}: not a store key")
            file_meta, tensors = read_state_file(path)
            ids = tensors["token_ids"].tolist()
            mfp, tfp = file_meta["model_fingerprint"], file_meta["tokenizer_fingerprint"]
            if content_key(mfp, tfp, ids, self.chunk_tokens) != key:
                raise CorruptCacheError(f"{path}: contents do not match the key")
            lengths = [tensors[f"layer.{i}.keys"].shape[-2] for i in range(file_meta["n_layers"])]
        except (CorruptCacheError, KeyError, TypeError, ValueError):
            path.unlink(missing_ok=True)
            self._counts["corrupt"] += 1
            return
        hashes = chunk_hashes(chain_root(mfp, tfp), ids, self.chunk_tokens)
        meta = EntryMeta(
            key=key,
            n_tokens=len(ids),
            model_fingerprint=mfp,
            tokenizer_fingerprint=tfp,
            chunk_hashes=tuple(hashes[1:]),
            cuttable=all(n == len(ids) for n in lengths),
            file_bytes=path.stat().st_size,
            created=path.stat().st_mtime,
        )
        self._write_record(meta)

    # ---------------------------------------------------------------- disk tier

    def _kv_path(self, key: str) -> Path:
        return self._entries / f"{key}.kv"

    def _read_record(self, key: str) -> EntryMeta | None:
        try:
            meta = EntryMeta.from_json((self._entries / f"{key}.json").read_text())
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            return None
        return meta if meta.key == key else None

    def _write_record(self, meta: EntryMeta) -> None:
        atomic_write(self._entries / f"{meta.key}.json", meta.to_json())
        self._index_stamp = None

    def _put_disk(self, state: KVState, meta: EntryMeta) -> EntryMeta:
        """Write (or refresh) an entry and evict to the budget; returns the stored record."""
        path = self._kv_path(meta.key)
        existing = self._read_record(meta.key)
        if existing is not None and path.exists():
            meta = replace(existing, expires=meta.expires)
            self._write_record(meta)
            _touch(path)
            return meta
        if self.max_bytes is not None:
            size = _estimated_file_bytes(state)
            pinned = sum(m.file_bytes for m in self._refresh_index().values() if m.pinned)
            if size > self.max_bytes - pinned:
                self._counts["rejected"] += 1
                return meta
        save_state(state, path)
        meta = replace(meta, file_bytes=path.stat().st_size)
        self._write_record(meta)
        self._evict_disk(protect=meta.key)
        return meta

    def _evict_disk(self, protect: str | None = None) -> None:
        """Sweep leftovers, drop expired entries, then least recently used unpinned ones while
        the directory holds more than ``max_bytes`` (lock held)."""
        self._sweep_leftovers()
        now = time.time()
        index = self._refresh_index()
        for meta in list(index.values()):
            if meta.expired(now) and meta.key != protect:
                self._delete_files(meta.key)
                self._counts["expired"] += 1
        if self.max_bytes is None:
            return
        index = self._refresh_index()
        total = self._disk_bytes
        if total <= self.max_bytes:
            return
        victims = []
        for meta in index.values():
            if meta.pinned or meta.key == protect:
                continue
            try:
                victims.append((self._kv_path(meta.key).stat().st_mtime, meta))
            except FileNotFoundError:
                continue
        for _, meta in sorted(victims, key=lambda v: v[0]):
            if total <= self.max_bytes:
                break
            total -= self._sizes.get(meta.key, meta.file_bytes)
            self._delete_files(meta.key)
            self._counts["evictions"] += 1

    def _delete_files(self, key: str) -> bool:
        """Remove an entry's files, record first (lock held). Returns whether it existed."""
        existed = False
        for suffix in (".json", ".kv"):
            try:
                (self._entries / f"{key}{suffix}").unlink()
                existed = True
            except FileNotFoundError:
                pass
        self._index_stamp = None
        return existed

    def _drop(self, key: str, reason: str, seen: os.stat_result | None = None) -> None:
        """Remove a bad entry from both tiers; on disk only if the file is still the one read."""
        with self._mutex:
            self._memory.pop(key, None)
        with self._write_lock():
            if seen is not None and not _same_file(self._kv_path(key), seen):
                return  # removed or rewritten by another writer since we read it
            self._delete_files(key)
        self._counts[reason] += 1

    def _from_disk(
        self, key: str, fps: tuple[str, str], model: PreTrainedModel, tokenizer
    ) -> KVState | None:
        meta = self._read_record(key)
        if meta is None:
            return None
        if meta.expired(time.time()):
            self._drop(key, "expired")
            return None
        _check_fingerprints(meta, fps, model)
        path = self._kv_path(key)
        try:
            seen = path.stat()
            file_meta, tensors = read_state_file(path)
            ids = tensors["token_ids"].tolist()
            if (
                content_key(*fps, ids, self.chunk_tokens) != key
                or (
                    file_meta.get("model_fingerprint"),
                    file_meta.get("tokenizer_fingerprint"),
                )
                != fps
            ):
                raise CorruptCacheError(f"{path}: contents do not match the key")
            state = state_from_parts(file_meta, tensors, model, tokenizer)
        except FileNotFoundError:
            return None  # evicted by another writer meanwhile
        except (CorruptCacheError, KeyError) as e:
            if not _same_file(path, seen):
                return None  # evicted or rewritten by another writer while we read it
            warnings.warn(f"kvedit store: dropping corrupt entry {key}: {e}", stacklevel=3)
            self._drop(key, "corrupt", seen)
            return None
        _touch(path)
        self._remember(key, state, meta)
        return state

    def _set_pinned(self, key: str, pinned: bool) -> None:
        found = False
        with self._mutex:
            entry = self._memory.get(key)
            if entry is not None:
                entry.meta = replace(entry.meta, pinned=pinned)
                found = True
        with self._write_lock():
            meta = self._read_record(key)
            if meta is not None:
                self._write_record(replace(meta, pinned=pinned))
                found = True
        if not found:
            raise EntryNotFoundError(f"no entry {key} in {self.root}")
        if not pinned:
            with self._mutex:
                self._shrink_memory()

    def _refresh_index(self) -> dict[str, EntryMeta]:
        """The disk records by key, re-read whenever the entries directory changed.

        A change shows as a new directory mtime. Timestamps are coarse (a clock tick), so a
        scan made within a second of the mtime is not trusted (another process may have
        written in the same tick after it): the next call scans again, as git does for
        "racily clean" files.
        """
        with self._mutex:
            scan_time = time.time()
            try:
                st = os.stat(self._entries)
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = None
            if stamp is not None and stamp == self._index_stamp:
                return self._index
            index = {}
            sizes: dict[str, int] = {}
            disk_bytes = stray_files = stray_bytes = 0
            for name, size in _listing(self._entries):
                disk_bytes += size
                stem, _, suffix = name.rpartition(".")
                if suffix in ("kv", "json") and _KEY.fullmatch(stem):
                    sizes[stem] = sizes.get(stem, 0) + size
                    if suffix == "json":
                        meta = self._read_record(stem)
                        if meta is not None:
                            index[meta.key] = meta
                else:
                    stray_files += 1
                    stray_bytes += size
            self._sizes, self._disk_bytes = sizes, disk_bytes
            self._stray = (stray_files, stray_bytes)
            by_level: dict[str, set[str]] = {}
            for meta in index.values():
                for level in meta.levels():
                    by_level.setdefault(level, set()).add(meta.key)
            settled = stamp is not None and scan_time - stamp[1] / 1e9 > _RACY_SECONDS
            self._index, self._by_level = index, by_level
            self._index_stamp = stamp if settled else None
            return index

    # ---------------------------------------------------------------- memory tier

    def _remember(self, key: str, state: KVState, meta: EntryMeta) -> None:
        if not self.memory_bytes:
            return
        nbytes = state.nbytes
        if nbytes > self.memory_bytes:
            return
        with self._mutex:
            self._memory[key] = _MemoryEntry(
                state.replace(model=None, tokenizer=None), meta, nbytes
            )
            self._memory.move_to_end(key)
            self._shrink_memory(protect=key)

    def _shrink_memory(self, protect: str | None = None) -> None:
        total = sum(e.nbytes for e in self._memory.values())
        for key in list(self._memory):
            if total <= self.memory_bytes:
                break
            entry = self._memory[key]
            if entry.meta.pinned or key == protect:
                continue
            del self._memory[key]
            total -= entry.nbytes

    def _from_memory(
        self, key: str, fps: tuple[str, str], model: PreTrainedModel, tokenizer
    ) -> KVState | None:
        with self._mutex:
            entry = self._memory.get(key)
            if entry is None:
                return None
            if entry.meta.expired(time.time()):
                del self._memory[key]
                entry = None
            else:
                self._memory.move_to_end(key)
        if entry is None:
            self._drop(key, "expired")
            return None
        _check_fingerprints(entry.meta, fps, model)
        return entry.state.replace(model=model, tokenizer=tokenizer)

    # ---------------------------------------------------------------- prefix matching

    def _candidates(self, hashes: list[str], ids: list[int]) -> Iterator[tuple[str, int]]:
        """``(key, n_tokens)`` of usable stored prefixes of ``ids``, best (longest) first.

        At each chunk depth ``j`` from the deepest shared one down: entries whose ids are all
        a prefix of the prompt (checked by hashing the prompt's ids to the entry's length),
        longest first, then entries that share the first ``j`` chunks and can be cut there.
        """
        chunk = self.chunk_tokens
        index = self._refresh_index()
        by_level = self._by_level
        now = time.time()
        with self._mutex:
            memory = {k: e.meta for k, e in self._memory.items()}
        for j in range(len(hashes) - 1, -1, -1):
            level = hashes[j]
            keys = set(by_level.get(level, ())) | {
                k for k, m in memory.items() if level in m.levels()
            }
            metas = [memory.get(k) or index.get(k) for k in keys]
            metas = [m for m in metas if m is not None and not m.expired(now)]
            whole = [
                m
                for m in metas
                if m.n_tokens <= len(ids) and tail_key(level, ids[j * chunk : m.n_tokens]) == m.key
            ]
            for m in sorted(whole, key=lambda m: -m.n_tokens):
                yield m.key, m.n_tokens
            if j > 0:
                cut = [m for m in metas if m.cuttable and m.n_tokens > j * chunk]
                for m in sorted(cut, key=lambda m: (m.key not in memory, m.n_tokens)):
                    yield m.key, j * chunk

    def _as_prefix(
        self, stored: KVState, n: int, ids: list[int], offsets: torch.Tensor, text: str
    ) -> KVState:
        """``stored`` as the state of the prompt's first ``n`` tokens, with the prompt's text."""
        whole = n == len(stored)
        m = n if whole else n - 1  # a cut state's last token is recomputed for its logits

        def text_end(k: int) -> int:
            return len(text) if k == len(ids) else int(offsets[:k, 1].max()) if k else 0

        base = stored.replace(
            layers=stored.layers if whole else cut_layers(stored.layers, m),
            token_ids=torch.tensor(ids[:m], dtype=torch.long),
            offsets=offsets[:m].clone(),
            text=text[: text_end(m)],
            position_ids=torch.arange(m),
            next_position=m,
        )
        if whole:
            return base
        return extend_ids(base, ids[m:n], offsets[m:n], text[: text_end(n)])

    # ---------------------------------------------------------------- helpers

    def _fingerprints(self, model: PreTrainedModel, tokenizer) -> tuple[str, str]:
        return model_fingerprint(model), tokenizer_fingerprint(tokenizer)


def _check_key(key: str) -> str:
    if not isinstance(key, str):
        raise InvalidTypeError(f"not a KVStore key (32 lowercase hex digits): {key!r}")
    if not _KEY.fullmatch(key):
        raise InvalidInputError(f"not a KVStore key (32 lowercase hex digits): {key!r}")
    return key


def _listing(folder: Path) -> list[tuple[str, int]]:
    """``(name, bytes)`` of everything in ``folder`` (a directory counts what it holds)."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return out
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                size = sum(
                    (Path(root) / f).stat().st_size
                    for root, _, files in os.walk(entry.path)
                    for f in files
                )
            else:
                size = entry.stat(follow_symlinks=False).st_size
        except OSError:  # removed meanwhile
            continue
        out.append((entry.name, size))
    return out


def _check_fingerprints(meta: EntryMeta, fps: tuple[str, str], model) -> None:
    if (meta.model_fingerprint, meta.tokenizer_fingerprint) != fps:
        raise CacheMismatchError(
            f"store entry {meta.key} was made by another model or tokenizer "
            f"(model {getattr(model, 'name_or_path', '?')!r})"
        )


def _same_file(path: Path, seen: os.stat_result) -> bool:
    """Whether ``path`` is still the file ``seen`` described: not removed or replaced (a
    rewrite is a new file renamed in place; the mtime is not compared, readers touch it)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino, now.st_size) == (seen.st_dev, seen.st_ino, seen.st_size)


def _touch(path: Path) -> None:
    """Mark an entry as just used (its mtime orders LRU eviction)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def _estimated_file_bytes(state: KVState) -> int:
    tensors = [state.token_ids, state.offsets, state.position_ids, state.last_logits]
    for layer in state.layers:
        tensors += [layer.keys, layer.values, layer.token_index, layer.positions]
    return sum(t.numel() * t.element_size() for t in tensors) + 4096 + len(state.text) * 4
