"""The store's directory: where its files are, its configuration, and which names are the
temporary files of writers::

    root/store.json          format version and chunk size
    root/.lock               the write lock (kvedit.store.lock) serialising writers
    root/entries/KEY.kv      the state: safetensors, JSON header, seal (kvedit.states.files)
    root/entries/KEY.json    the entry's index record: token count, chunk hashes, pin, expiry

How the disk tier writes, reads and recovers them: :mod:`kvedit.store.disk`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..atomic import atomic_write, is_temp_name
from ..errors import CorruptCacheError, InvalidInputError, StoreUnavailableError
from .keys import CHUNK_TOKENS, STORE_FORMAT, STORE_VERSION

ENTRIES_DIR = "entries"
CONFIG_NAME = "store.json"
# Temporary files of older writers: kvedit 0.1's ``.NAME.XXXXXXXX.tmp`` and safetensors'
# ``.tmpXXXXXX`` (safetensors writes beside its target, then renames).
_OLD_TEMP = re.compile(r"\..+\.tmp|\.tmp[A-Za-z0-9_]{6}")

__all__ = ["CONFIG_NAME", "ENTRIES_DIR", "is_leftover", "make_dirs", "open_config"]


def make_dirs(root: Path) -> None:
    """Create ``root/entries`` (and ``root``); :class:`~kvedit.errors.StoreUnavailableError`
    if that fails."""
    try:
        (root / ENTRIES_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreUnavailableError(
            f"{root}: cannot create the store's directory: {e.strerror or e}"
        ) from e


def open_config(root: Path, chunk_tokens: int | None) -> int:
    """The store's chunk size from ``root/store.json``, written first if missing (lock held).

    Raises:
        CorruptCacheError: the file is not a kvedit store configuration.
        InvalidInputError: ``chunk_tokens`` differs from the size the store was created with.
    """
    path = root / CONFIG_NAME
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
                f"{root} was created with chunk_tokens={stored}, not {chunk_tokens}"
            )
        return stored
    chunk = chunk_tokens or CHUNK_TOKENS
    config = {"format": STORE_FORMAT, "version": STORE_VERSION, "chunk_tokens": chunk}
    make_dirs(root)
    atomic_write(path, json.dumps(config))
    return chunk


def is_leftover(name: str) -> bool:
    """Whether a file name is a temporary file some writer left (never an entry or record)."""
    return is_temp_name(name) or bool(_OLD_TEMP.fullmatch(name))
