"""Store keys: chained content hashes of a model, a tokenizer and token ids.

A state is stored under the hash of its model and tokenizer fingerprints and its token ids,
computed in chunks of ``chunk`` ids (:data:`CHUNK_TOKENS`, 256, unless the store was created
with another size) with chained hashes, as LMCache does::

    h_0     = H("kvedit.store/1", model fingerprint, tokenizer fingerprint)
    h_{j+1} = H(h_j, ids of chunk j)                       (chunk j = ids[256 j : 256 (j + 1)])
    key     = h_m if n == 256 m, else H(h_m, ids[256 m : n])         (m = n // 256)

``H`` is SHA-256 over length-prefixed parts, cut to 32 lowercase hex digits; ids are hashed as
int64. Every entry is indexed under the chain hashes of its full chunks, so the longest stored
prefix of a new prompt is found by hashing the prompt's chunks (:mod:`kvedit.store.matching`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import torch

from ..errors import InvalidInputError, InvalidTypeError

CHUNK_TOKENS = 256
"""Ids per hashed chunk of a new store."""
STORE_FORMAT = "kvedit.store"
STORE_VERSION = 1
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")
"""What every key (and chain hash) looks like: 32 lowercase hex digits."""
_HASH_LEN = 32

__all__ = [
    "CHUNK_TOKENS",
    "KEY_PATTERN",
    "STORE_FORMAT",
    "STORE_VERSION",
    "chain_root",
    "check_key",
    "chunk_hashes",
    "content_key",
    "is_key",
    "tail_key",
]


def _h(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:_HASH_LEN]


def _id_bytes(ids: Sequence[int]) -> bytes:
    """The bytes of ``ids`` as an int64 tensor ``[len(ids)]``."""
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


def is_key(text: str) -> bool:
    """Whether ``text`` has the form of a key (32 lowercase hex digits)."""
    return bool(KEY_PATTERN.fullmatch(text))


def check_key(key: object) -> str:
    """``key`` if it is a key, else :class:`~kvedit.errors.InvalidTypeError` (not a ``str``) or
    :class:`~kvedit.errors.InvalidInputError` (not 32 lowercase hex digits)."""
    if not isinstance(key, str):
        raise InvalidTypeError(f"not a KVStore key (32 lowercase hex digits): {key!r}")
    if not is_key(key):
        raise InvalidInputError(f"not a KVStore key (32 lowercase hex digits): {key!r}")
    return key
