"""What the store's entries directory holds: one scan of it (:func:`scan`, a
:class:`DiskIndex`): the entries' records, the keys indexed under each chain hash, the bytes of
each entry and of everything else (what ``max_bytes`` bounds).

The disk tier (:mod:`kvedit.store.disk`) keeps the last scan and scans again when the directory
changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import left_by_dead_writer, remove_temp
from .keys import is_key
from .records import EntryMeta

__all__ = ["DiskIndex", "scan"]


@dataclass(frozen=True)
class DiskIndex:
    """One scan of the entries directory.

    Attributes:
        records: the entries' records by key (entries whose ``.json`` parses).
        by_level: the keys indexed under each chain hash (:meth:`EntryMeta.levels`).
        sizes: bytes of each key's ``.kv`` and ``.json`` together.
        total_bytes: everything the directory holds (what ``max_bytes`` bounds).
        stray_files, stray_bytes: files (and their bytes) that are no entry's, such as the
            temporary files of writers that died.
    """

    records: dict[str, EntryMeta] = field(default_factory=dict)
    by_level: dict[str, set[str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0
    stray_files: int = 0
    stray_bytes: int = 0


def scan(entries: Path, read_record: Callable[[str], EntryMeta | None]) -> DiskIndex:
    """One scan of the ``entries`` directory, each ``KEY.json`` read by ``read_record(KEY)``
    (None for a missing or malformed record). The temporary files of this machine's dead
    writers are removed on the way (no lock needed: their writers are gone), and not counted."""
    records = {}
    sizes: dict[str, int] = {}
    total = stray_files = stray_bytes = 0
    for name, size in _listing(entries):
        if left_by_dead_writer(entries / name):  # no lock needed: its writer is gone
            remove_temp(entries / name)
            continue
        total += size
        stem, _, suffix = name.rpartition(".")
        if suffix in ("kv", "json") and is_key(stem):
            sizes[stem] = sizes.get(stem, 0) + size
            if suffix == "json":
                meta = read_record(stem)
                if meta is not None:
                    records[meta.key] = meta
        else:
            stray_files += 1
            stray_bytes += size
    by_level: dict[str, set[str]] = {}
    for meta in records.values():
        for level in meta.levels():
            by_level.setdefault(level, set()).add(meta.key)
    return DiskIndex(records, by_level, sizes, total, stray_files, stray_bytes)


def _listing(folder: Path) -> list[tuple[str, int]]:
    """``(name, bytes)`` of everything in ``folder`` (a directory counts what it holds)."""
    out: list[tuple[str, int]] = []
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
