"""Prefix matching: which stored entries can stand for the start of a prompt, and how.

The prompt's ids are hashed chunk by chunk (:func:`~kvedit.store.keys.chunk_hashes`). An entry
whose ids are all a prefix of the prompt is used whole; otherwise an entry that shares the
prompt's first ``j`` chunks is cut to ``chunk * j`` tokens, which needs every layer to hold
every token (a state of a model with sliding-window layers, such as Gemma-3, holds only the
last ``window`` tokens there, so it can be used whole but not cut). Two entries with a
common prefix both hold it: entries are whole states, never deduplicated per chunk.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..states.capturing import cut_layers, extend_ids
from ..states.state import KVState
from .keys import tail_key
from .records import EntryMeta

__all__ = ["PrefixMatch", "as_prefix", "candidates"]


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


def candidates(
    hashes: list[str],
    ids: list[int],
    chunk: int,
    on_disk: Mapping[str, EntryMeta],
    by_level: Mapping[str, Collection[str]],
    in_memory: Mapping[str, EntryMeta],
) -> Iterator[tuple[str, int]]:
    """``(key, n_tokens)`` of usable stored prefixes of ``ids``, best (longest) first.

    Args:
        hashes: the prompt's chain hashes ``[h_0 .. h_m]``.
        ids: the prompt's token ids.
        chunk: ids per hashed chunk.
        on_disk, by_level: the disk tier's records by key, and its keys by chain hash.
        in_memory: the memory tier's records by key (preferred over the disk's).

    At each chunk depth ``j`` from the deepest shared one down: entries whose ids are all a
    prefix of the prompt (checked by hashing the prompt's ids to the entry's length), longest
    first, then entries that share the first ``j`` chunks and can be cut there (those in
    memory first, then the shortest). Expired entries are skipped.
    """
    now = time.time()
    for j in range(len(hashes) - 1, -1, -1):
        level = hashes[j]
        keys = set(by_level.get(level, ())) | {
            k for k, m in in_memory.items() if level in m.levels()
        }
        metas = [in_memory.get(k) or on_disk.get(k) for k in keys]
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
            for m in sorted(cut, key=lambda m: (m.key not in in_memory, m.n_tokens)):
                yield m.key, j * chunk


def as_prefix(stored: KVState, n: int, ids: list[int], offsets: torch.Tensor, text: str) -> KVState:
    """``stored`` as the state of the prompt's first ``n`` tokens, with the prompt's text.

    ``ids`` are the prompt's token ids and ``offsets`` (``[len(ids), 2]``) their character
    ranges in ``text``. A whole entry (``n == len(stored)``) takes the prompt's ids, offsets and
    text; a cut one keeps its first ``n - 1`` tokens and runs token ``n - 1`` again on top, so
    that its ``last_logits`` are right.
    """
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
        last_input=None,  # the last of the m tokens (a stored state is a plain capture)
    )
    if whole:
        return base
    return extend_ids(base, ids[m:n], offsets[m:n], text[: text_end(n)])
