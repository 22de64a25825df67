"""The disk tier: entries as files under the store's directory, LRU by bytes up to a budget.

The directory's layout and configuration: :mod:`kvedit.store.layout`; one scan of its entries:
:mod:`kvedit.store.index`. Safety: an entry's two files (``KEY.kv``, ``KEY.json``) are written by
:func:`kvedit.atomic.atomic_write` (a temporary name ``.NAME.kvedit-tmp-*``, fsync, rename), the
``.kv`` first: an entry exists once its ``.json`` does. Writers hold the lock while they write, so
several writers (in threads or processes) are serialised, never interleaved, and a temporary file
seen by a holder of the lock belongs to a writer that died. Readers take no lock: a rename is atomic
and an open file survives deletion. Opening a store recovers from a writer killed mid-write:
temporary files are removed (kvedit's own, and the ``.*.tmp`` and ``.tmpXXXXXX`` files of kvedit 0.1
and safetensors), a ``.kv`` without ``.json`` gets its record rebuilt from the file (or is removed
if it does not verify), a ``.json`` without ``.kv`` is removed; every write sweeps temporary files
again, and every scan (a lookup, :meth:`~kvedit.KVStore.stats`) removes those of this machine's dead
writers (:func:`kvedit.atomic.left_by_dead_writer`). Until then, whatever the entries directory
holds (records and leftovers included) counts against ``max_bytes`` and shows in
:meth:`~kvedit.KVStore.stats`. A store whose directory was deleted recreates it on the next write.
The index is rebuilt from the ``.json`` records whenever the directory changes. A corrupt entry
fails its seal (:class:`~kvedit.errors.CorruptCacheError`) when read, and is dropped, never served.
Nothing is ever pickled. A state file records its history (since format 3); :class:`~kvedit.KVStore`
serves an entry only when that history is a plain capture.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..atomic import atomic_write, remove_temp
from ..errors import CorruptCacheError
from ..states.files.read import read_state_file, state_from_parts
from ..states.files.write import save_state
from ..states.state import KVState
from .index import DiskIndex, scan
from .keys import content_key, is_key
from .layout import CONFIG_NAME, ENTRIES_DIR, is_leftover, make_dirs, open_config
from .lock import StoreLock
from .records import EntryMeta

# A directory listing made this soon after the directory's mtime may miss a write made in the
# same timestamp tick; such a listing is redone on the next lookup.
_RACY_SECONDS = 1.0

__all__ = ["DiskRead", "DiskTier", "estimated_file_bytes"]


class DiskRead(NamedTuple):
    """What :meth:`DiskTier.read` found.

    Attributes:
        state: the entry's state, or None (missing, replaced meanwhile, or corrupt).
        problem: why the file is corrupt, when it is (and still the file that was read).
        seen: the corrupt file's ``stat``, so that only that file is dropped.
    """

    state: KVState | None
    problem: str | None = None
    seen: os.stat_result | None = None


class DiskTier:
    """The entries under ``root``, their index, the write lock, and recovery.

    Opening one creates the directories, reads (or writes) the configuration, recovers from
    writers that died and evicts to the budget, all under the lock.

    Args:
        root: the store's directory.
        chunk_tokens: ids per hashed chunk for a new store (None: the stored one, or 256).
        max_bytes: budget of the entries directory (None: unbounded).
        lock_timeout: seconds a writer waits for the lock.
        counts: the store's counters; this tier adds ``expired``, ``evictions`` and
            ``corrupt`` (records rebuilt from nothing) to them.
    """

    def __init__(
        self,
        root: Path,
        *,
        chunk_tokens: int | None,
        max_bytes: int | None,
        lock_timeout: float,
        counts: Counter,
    ) -> None:
        self.root = root
        self.entries = root / ENTRIES_DIR
        self.max_bytes = max_bytes
        self.counts = counts
        self.lock = StoreLock(root, lock_timeout)
        self._mutex = threading.RLock()  # guards the cached index
        self._index = DiskIndex()
        self._stamp: tuple[int, int, int] | None = None
        make_dirs(root)
        with self.lock.hold():
            self.chunk_tokens = open_config(root, chunk_tokens)
            self.recover()
            self.evict()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the write lock (re-entrant); a deleted store directory is recreated first."""
        outermost = not self.lock.held
        if outermost and not self.root.is_dir():
            make_dirs(self.root)
            self.invalidate()
        with self.lock.hold():
            if outermost and not (self.root / CONFIG_NAME).exists():
                open_config(self.root, self.chunk_tokens)  # the directory was deleted meanwhile
            yield

    # ---------------------------------------------------------------- files of one entry

    def kv_path(self, key: str) -> Path:
        """Where the state of ``key`` is stored."""
        return self.entries / f"{key}.kv"

    def read_record(self, key: str) -> EntryMeta | None:
        """The record of ``key``, or None if it is missing or malformed."""
        try:
            meta = EntryMeta.from_json(json.loads((self.entries / f"{key}.json").read_text()))
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            return None
        return meta if meta.key == key else None

    def stored_record(self, key: str) -> EntryMeta | None:
        """The record of ``key`` if its state file exists too (a complete entry)."""
        meta = self.read_record(key)
        return meta if meta is not None and self.kv_path(key).exists() else None

    def write_record(self, meta: EntryMeta) -> None:
        """Write an entry's record (lock held): the entry exists from now on."""
        atomic_write(self.entries / f"{meta.key}.json", json.dumps(meta.to_json(), sort_keys=True))
        self.invalidate()

    def write_state(self, state: KVState, meta: EntryMeta) -> EntryMeta:
        """Write the state file of ``meta.key`` (lock held); returns ``meta`` with its size."""
        path = self.kv_path(meta.key)
        save_state(state, path)
        return replace(meta, file_bytes=path.stat().st_size)

    def has_room_for(self, state: KVState) -> bool:
        """Whether ``state``'s file fits in ``max_bytes`` beside the pinned entries."""
        if self.max_bytes is None:
            return True
        pinned = sum(m.file_bytes for m in self.index().records.values() if m.pinned)
        return estimated_file_bytes(state) <= self.max_bytes - pinned

    def touch(self, key: str) -> None:
        """Mark an entry as just used (its mtime orders LRU eviction)."""
        with contextlib.suppress(OSError):
            os.utime(self.kv_path(key))

    def set_pinned(self, key: str, pinned: bool) -> bool:
        """Rewrite the record of ``key`` with ``pinned``; returns whether it has one."""
        with self.locked():
            meta = self.read_record(key)
            if meta is None:
                return False
            self.write_record(replace(meta, pinned=pinned))
            return True

    def delete(self, key: str, seen: os.stat_result | None = None) -> bool:
        """Remove the files of ``key``, record first; with ``seen``, only if the state file is
        still that one (not removed or rewritten by another writer since). Returns whether
        anything was removed."""
        with self.locked():
            if seen is not None and not _same_file(self.kv_path(key), seen):
                return False
            return self._delete_files(key)

    def _delete_files(self, key: str) -> bool:
        """Remove an entry's files, record first (lock held). Returns whether it existed."""
        existed = False
        for suffix in (".json", ".kv"):
            try:
                (self.entries / f"{key}{suffix}").unlink()
                existed = True
            except FileNotFoundError:
                pass
        self.invalidate()
        return existed

    def read(
        self,
        key: str,
        fps: tuple[str, str],
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
    ) -> DiskRead:
        """The state of ``key`` bound to ``model``/``tokenizer``, once its file has passed its
        seal (or an older format's CRC-32) and its token ids and fingerprints ``fps`` give
        ``key``; takes no lock."""
        path = self.kv_path(key)
        try:
            seen = path.stat()
            found = read_state_file(path)
            file_meta, tensors = found.meta, found.tensors
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
            # a file this installation did not write (or older than format 4) loads with an
            # unknown history: the store drops it as stale, never serves it
            state = state_from_parts(
                file_meta, tensors, model, tokenizer, path=path, trusted=found.trusted
            )
        except FileNotFoundError:
            return DiskRead(None)  # evicted by another writer meanwhile
        except (CorruptCacheError, KeyError) as e:
            if not _same_file(path, seen):
                return DiskRead(None)  # evicted or rewritten by another writer while we read it
            return DiskRead(None, f"{e}", seen)
        return DiskRead(state)

    # ---------------------------------------------------------------- the whole directory

    def invalidate(self) -> None:
        """Make the next :meth:`index` scan the directory again."""
        self._stamp = None

    def index(self) -> DiskIndex:
        """The entries directory, scanned again whenever it changed.

        A change shows as a new directory mtime. Timestamps are coarse (a clock tick), so a
        scan made within a second of the mtime is not trusted (another process may have
        written in the same tick after it): the next call scans again, as git does for
        "racily clean" files.
        """
        with self._mutex:
            scan_time = time.time()
            try:
                st = os.stat(self.entries)
                stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = None
            if stamp is not None and stamp == self._stamp:
                return self._index
            self._index = scan(self.entries, self.read_record)
            settled = stamp is not None and scan_time - stamp[1] / 1e9 > _RACY_SECONDS
            self._stamp = stamp if settled else None
            return self._index

    def evict(self, protect: str | None = None) -> None:
        """Sweep leftovers, drop expired entries, then least recently used unpinned ones while
        the directory holds more than ``max_bytes`` (lock held; ``protect`` is kept)."""
        self.sweep_leftovers()
        now = time.time()
        for meta in list(self.index().records.values()):
            if meta.expired(now) and meta.key != protect:
                self._delete_files(meta.key)
                self.counts["expired"] += 1
        if self.max_bytes is None:
            return
        index = self.index()
        total = index.total_bytes
        if total <= self.max_bytes:
            return
        victims = []
        for meta in index.records.values():
            if meta.pinned or meta.key == protect:
                continue
            try:
                victims.append((self.kv_path(meta.key).stat().st_mtime, meta))
            except FileNotFoundError:
                continue
        for _, meta in sorted(victims, key=lambda v: v[0]):
            if total <= self.max_bytes:
                break
            total -= index.sizes.get(meta.key, meta.file_bytes)
            self._delete_files(meta.key)
            self.counts["evictions"] += 1

    def sweep_leftovers(self) -> None:
        """Remove the temporary files of writers that died (lock held: every live writer holds
        the lock while its temporary file exists, so none seen now is in use)."""
        removed = False
        for folder in (self.root, self.entries):
            try:
                names = os.listdir(folder)
            except FileNotFoundError:
                continue
            for name in names:
                if not is_leftover(name):
                    continue
                remove_temp(folder / name)
                removed = True
        if removed:
            self.invalidate()

    def recover(self) -> None:
        """Bring the directory back to a consistent state after a writer died (lock held)."""
        self.sweep_leftovers()
        kv = {p.stem for p in self.entries.glob("*.kv")}
        records = {p.stem for p in self.entries.glob("*.json")}
        for key in records - kv:
            (self.entries / f"{key}.json").unlink(missing_ok=True)
        for key in sorted(kv):
            if self.read_record(key) is None:
                self._rebuild_record(key)

    def _rebuild_record(self, key: str) -> None:
        """Write the ``.json`` of a ``.kv`` left without one, or remove the ``.kv`` if bad."""
        path = self.kv_path(key)
        try:
            if not is_key(key):
                raise CorruptCacheError(f"{path}: not a store key")
            found = read_state_file(path)
            if not found.trusted:
                return  # not written by this installation: never served, left as it is
            file_meta, tensors = found.meta, found.tensors
            ids = tensors["token_ids"].tolist()
            mfp, tfp = file_meta["model_fingerprint"], file_meta["tokenizer_fingerprint"]
            if content_key(mfp, tfp, ids, self.chunk_tokens) != key:
                raise CorruptCacheError(f"{path}: contents do not match the key")
            lengths = [tensors[f"layer.{i}.keys"].shape[-2] for i in range(file_meta["n_layers"])]
        except (CorruptCacheError, KeyError, TypeError, ValueError):
            path.unlink(missing_ok=True)
            self.counts["corrupt"] += 1
            return
        st = path.stat()
        meta = EntryMeta.build(
            ids,
            mfp,
            tfp,
            lengths,
            self.chunk_tokens,
            file_bytes=st.st_size,
            created=st.st_mtime,
        )
        self.write_record(meta)


def estimated_file_bytes(state: KVState) -> int:
    """About the size of ``state``'s ``.kv`` file: its tensors (``token_ids [n]``,
    ``offsets [n, 2]``, ``position_ids [n]``, ``last_logits [vocab]``, and per layer
    ``keys``/``values [batch, kv_heads, len, head_dim]``, ``token_index``/``positions
    [len]``), plus room for the header and text."""
    tensors = [state.token_ids, state.offsets, state.position_ids, state.last_logits]
    for layer in state.layers:
        tensors += [layer.keys, layer.values, layer.token_index, layer.positions]
    return sum(t.numel() * t.element_size() for t in tensors) + 4096 + len(state.text) * 4


def _same_file(path: Path, seen: os.stat_result) -> bool:
    """Whether ``path`` is still the file ``seen`` described: not removed or replaced (a
    rewrite is a new file renamed in place; the mtime is not compared, readers touch it)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino, now.st_size) == (seen.st_dev, seen.st_ino, seen.st_size)
