"""KVStore: the content-addressed, two-tier store of captured states, built from its parts.

Entries live on disk under ``root`` (:mod:`kvedit.store.disk`, LRU by bytes up to
``max_bytes``); an optional in-memory tier in front (:mod:`kvedit.store.ram`, LRU up to
``memory_bytes``) keeps recently used states ready. ``pin`` keeps an entry in both tiers and
exempts it from expiry; ``put(..., ttl=s)`` makes it expire after ``s`` seconds. Keys are
chained hashes of the token ids (:mod:`kvedit.store.keys`), so the longest stored prefix of a
prompt is found chunk by chunk (:mod:`kvedit.store.matching`). Passages (texts cached on their
own, see :func:`~kvedit.states.capturing.capture_passage`) are entries like any other, keyed by
their ids, which is what :func:`~kvedit.blend` looks them up by.

Unlike LMCache, an entry is one whole state (one file), not one file per chunk: two entries
with a common prefix both hold it (no deduplication), in exchange for one file per entry,
simple eviction and pinning, and no chain of chunk files to keep consistent.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import checks
from ..errors import EntryNotFoundError, InvalidInputError, InvalidTypeError, StateAlteredError
from ..fingerprint import model_fingerprint, tokenizer_fingerprint
from ..states.capturing import encode
from ..states.state import KVState
from .disk import DiskTier
from .keys import chain_root, check_key, chunk_hashes, content_key
from .matching import PrefixMatch, as_prefix, candidates
from .ram import MemoryTier
from .records import EntryMeta, check_fingerprints, check_storable, storable_problem

__all__ = ["KVStore"]

_COUNTERS = (
    "puts",
    "hits_memory",
    "hits_disk",
    "misses",
    "evictions",
    "expired",
    "corrupt",
    "rejected",
    "stale",
)


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
        allow_casts: dtypes (or their names) a stored or served state may have been cast to
            lossily, e.g. ``(torch.bfloat16,)`` to keep captures saved or loaded in bfloat16
            (lossless casts, such as bfloat16 to float32, are always allowed).

    The store holds what it says: plain captures, whose content is a function of the key (the
    model, the tokenizer and the token ids). :meth:`put` refuses any other state, by its
    history (:attr:`KVState.history <kvedit.KVState.history>`: an edit, a compression, a
    re-read, a projection, a blend, a lossy cast not allowed, or an unknown history), and a
    state read from disk is served only if its history is such a capture: an entry written
    before state-file format 4, or by another installation (its history cannot be believed), is a miss, dropped (counted as ``stale``), and recomputed
    by whoever wanted it.

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
        allow_casts: Sequence[torch.dtype | str] = (),
    ) -> None:
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
        if isinstance(allow_casts, (str, torch.dtype)):
            allow_casts = (allow_casts,)
        self.allow_casts = tuple(
            checks.save_dtype(getattr(torch, d, d) if isinstance(d, str) else d)
            for d in allow_casts
        )
        self._counts: Counter = Counter()
        self._memory = MemoryTier(self.memory_bytes)
        self._disk = DiskTier(
            self.root,
            chunk_tokens=chunk_tokens,
            max_bytes=max_bytes,
            lock_timeout=lock_timeout,
            counts=self._counts,
        )
        self.chunk_tokens = self._disk.chunk_tokens

    # ---------------------------------------------------------------- public API

    def key_for(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]
    ) -> str:
        """The key a state of token ``ids`` made by ``model``/``tokenizer`` is stored under."""
        mfp, tfp = self._fingerprints(model, tokenizer)
        return content_key(mfp, tfp, [int(i) for i in ids], self.chunk_tokens)

    def refusal(self, state: KVState) -> str | None:
        """Why this store would not hold or serve ``state`` (a phrase naming the first
        transformation in its history), or None for a plain capture (or an allowed cast of
        one)."""
        return storable_problem(state, self.allow_casts)

    def put(self, state: KVState, ttl: float | None = None) -> str:
        """Store ``state`` (a plain capture) and return its key (hex).

        ``ttl``: seconds until the entry expires (None: never); putting an existing key again
        refreshes it and sets its TTL anew. Raises :class:`~kvedit.errors.NotACaptureError`
        (an ``InvalidInputError``) for any state that is not a plain capture, naming the first transformation in its history
        (:meth:`~kvedit.provenance.History.first_change`): an edit (scaled keys, a bias,
        copies, a re-read), a compression, a projection, a blend, a lossy cast not in
        ``allow_casts``, or an unknown history; then for tensors that do not look like a
        capture (a bias, added or moved entries, quantized layers). The memory tier keeps a
        reference to ``state``'s tensors: if they are written in place later, the tier drops
        its copy and serves the disk's. Raises
        :class:`~kvedit.errors.StateAlteredError` for a state written in place since it was
        built.
        """
        if not isinstance(state, KVState):
            raise InvalidTypeError(f"put takes a KVState, not a {type(state).__name__}")
        state.check_unaltered("storing it")
        if ttl is not None:
            ttl = checks.real("ttl", ttl)
            if not ttl > 0:
                raise InvalidInputError(
                    f"ttl must be a positive number of seconds or None, not {ttl!r}"
                )
        check_storable(state, self.allow_casts)
        now = time.time()
        meta = EntryMeta.build(
            state.token_ids.tolist(),
            state.model_fingerprint,
            state.tokenizer_fingerprint,
            (len(layer) for layer in state.layers),
            self.chunk_tokens,
            file_bytes=0,
            created=now,
            expires=None if ttl is None else now + ttl,
        )
        with self._disk.locked():
            meta = self._put_disk(state, meta)
        self._memory.remember(meta.key, state, meta)
        self._counts["puts"] += 1
        return meta.key

    def get(
        self, key: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> KVState | None:
        """The stored state under ``key``, bound to ``model``/``tokenizer``, or None.

        Expired, missing and corrupt entries give None (a corrupt one is dropped). Raises
        :class:`~kvedit.errors.CacheMismatchError` if the entry was made by another model.
        """
        state, _ = self.fetch(check_key(key), model, tokenizer)
        return state

    def fetch(
        self, key: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[KVState | None, str]:
        """Like :meth:`get`, also saying where the state came from: ``"memory"``, ``"disk"``
        or ``"miss"``."""
        key = check_key(key)
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
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str
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
        tokenizer: PreTrainedTokenizerBase,
        ids: Sequence[int],
        offsets: torch.Tensor,
        text: str,
    ) -> PrefixMatch:
        """:meth:`longest_prefix` for an already tokenized prompt (``offsets [n, 2]`` into
        ``text``); the returned state's text and offsets are the prompt's."""
        ids = [int(i) for i in ids]
        mfp, tfp = self._fingerprints(model, tokenizer)
        hashes = chunk_hashes(chain_root(mfp, tfp), ids, self.chunk_tokens)
        index = self._disk.index()
        found = candidates(
            hashes, ids, self.chunk_tokens, index.records, index.by_level, self._memory.records()
        )
        for key, n in found:
            stored, source = self.fetch(key, model, tokenizer)
            if stored is None:
                continue
            state = as_prefix(stored, n, ids, offsets, text)
            return PrefixMatch(state, n, key, source)
        return PrefixMatch(None)

    def pin(self, key: str) -> None:
        """Keep ``key`` in both tiers and never let it expire, until :meth:`unpin`."""
        self._set_pinned(check_key(key), True)

    def unpin(self, key: str) -> None:
        """Make ``key`` evictable again (and subject to its TTL, if it has one)."""
        self._set_pinned(check_key(key), False)

    def evict(self, key: str) -> bool:
        """Remove ``key`` from both tiers (pinned or not). Returns whether it was stored."""
        key = check_key(key)
        in_memory = self._memory.pop(key)
        on_disk = self._disk.delete(key)
        return in_memory or on_disk

    def stats(self) -> dict:
        """Sizes of both tiers and this object's counters (hits, misses, evictions, ...).

        ``bytes`` is everything the entries directory holds: entries, their records, and
        ``stray_bytes`` in ``stray_files`` left by writers that died (removed by the next
        write or open); it is what ``max_bytes`` bounds.
        """
        index = self._disk.index()
        memory_entries, memory_bytes = self._memory.usage()
        out = {
            "entries": len(index.records),
            "bytes": index.total_bytes,
            "stray_files": index.stray_files,
            "stray_bytes": index.stray_bytes,
            "pinned": sum(m.pinned for m in index.records.values()),
            "memory_entries": memory_entries,
            "memory_bytes": memory_bytes,
            "max_bytes": self.max_bytes,
            "memory_limit": self.memory_bytes or None,
            "chunk_tokens": self.chunk_tokens,
        }
        for name in _COUNTERS:
            out[name] = self._counts[name]
        return out

    def __repr__(self) -> str:
        return (
            f"KVStore({str(self.root)!r}, max_bytes={self.max_bytes}, "
            f"memory_bytes={self.memory_bytes or None})"
        )

    # ---------------------------------------------------------------- writing

    def _put_disk(self, state: KVState, meta: EntryMeta) -> EntryMeta:
        """Write (or refresh) an entry and evict to the budget (lock held); returns the stored
        record. The state file is written first, then its record: the entry exists once its
        record does."""
        existing = self._disk.stored_record(meta.key)
        if existing is not None:
            meta = replace(existing, expires=meta.expires)
            self._write_record(meta)
            self._disk.touch(meta.key)
            return meta
        if not self._disk.has_room_for(state):
            self._counts["rejected"] += 1
            return meta
        meta = self._disk.write_state(state, meta)
        self._write_record(meta)
        self._disk.evict(protect=meta.key)
        return meta

    def _write_record(self, meta: EntryMeta) -> None:
        """Commit an entry by writing its record (lock held). One method of its own, so that a
        test can stop a writer between the state file and its record."""
        self._disk.write_record(meta)

    def _set_pinned(self, key: str, pinned: bool) -> None:
        found = self._memory.set_pinned(key, pinned)
        found = self._disk.set_pinned(key, pinned) or found
        if not found:
            raise EntryNotFoundError(f"no entry {key} in {self.root}")
        if not pinned:
            self._memory.shrink()

    def _drop(self, key: str, reason: str, seen: os.stat_result | None = None) -> None:
        """Remove a bad entry from both tiers; on disk only if the file is still the one read."""
        self._memory.pop(key)
        removed = self._disk.delete(key, seen)
        if removed or seen is None:  # not counted when another writer replaced the file
            self._counts[reason] += 1

    # ---------------------------------------------------------------- reading

    def _from_memory(
        self,
        key: str,
        fps: tuple[str, str],
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
    ) -> KVState | None:
        entry = self._memory.lookup(key)
        if entry is None:
            return None
        if entry.meta.expired(time.time()):
            self._drop(key, "expired")
            return None
        check_fingerprints(entry.meta, fps, model)
        if self.refusal(entry.state) is not None:  # pragma: no cover - put refuses them
            return None
        try:
            # the tier holds the caller's tensors: a write into them after put shows here
            entry.state.check_unaltered("serving it from the store's memory tier")
        except StateAlteredError as e:
            warnings.warn(f"kvedit store: {e}; serving the disk copy", stacklevel=4)
            self._memory.pop(key)
            return None
        return entry.state.replace(model=model, tokenizer=tokenizer)

    def _from_disk(
        self,
        key: str,
        fps: tuple[str, str],
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
    ) -> KVState | None:
        meta = self._disk.read_record(key)
        if meta is None:
            return None
        if meta.expired(time.time()):
            self._drop(key, "expired")
            return None
        check_fingerprints(meta, fps, model)
        read = self._disk.read(key, fps, model, tokenizer)
        if read.problem is not None:
            warnings.warn(
                f"kvedit store: dropping corrupt entry {key}: {read.problem}", stacklevel=3
            )
            self._drop(key, "corrupt", read.seen)
            return None
        if read.state is None:
            return None
        if not read.state.history.known or read.state.history.origin.kind != "capture":
            # not written by this installation (another's key, a file older than format 4)
            # or not a capture at all: a miss, recomputed by whoever wanted it, never served
            self._drop(key, "stale")
            return None
        if self.refusal(read.state) is not None:
            return (
                None  # a capture, but cast for this model in a way the store was not told to allow
            )
        self._disk.touch(key)
        self._memory.remember(key, read.state, meta)
        return read.state

    def _fingerprints(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[str, str]:
        return model_fingerprint(model), tokenizer_fingerprint(tokenizer)
