"""Taking a request's K/V back out of vLLM's paged cache: the connector's save path.

vLLM's attention backends lay a layer's cache out as they like (the CPU backend writes keys
column-major inside a ``[kv_heads, block, 2 * head_dim]`` block, other backends put keys and
values in separate planes), and the layout is not public. kvedit does not guess it:
:func:`probe` writes known codes through the backend's own ``do_kv_cache_update`` into a scratch
tensor shaped like the cache and reads back where each ``(slot, kv head, dim)`` landed, for the
keys and the values, giving a :class:`SlotMap` (flat offsets within a block, and the stride of
a block). :func:`gather` then reads any tokens of a request back as ``[n, kv_heads, head_dim]``
rows, the order a published file holds. A layout the probe cannot read (codes that do not
round-trip, blocks not evenly strided, a cache that is not one contiguous tensor) is refused in
words, before any save: nothing is saved from a layout kvedit cannot read exactly.

The codes are integers below ``2**24``, exact in float32 (what ``kvedit serve`` runs); a cache
of another dtype (bf16, fp8) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import KVEditError

__all__ = ["CODE_LIMIT", "SaveSpec", "Saver", "SlotMap", "gather", "probe", "save_spec"]

CODE_LIMIT = 2**24
"""Largest code a probe writes: every integer up to it is exact in float32."""

Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``write(keys [n, kv_heads, head_dim], values, cache, slots [n])``: the backend's own
``do_kv_cache_update`` for one layer."""


SAVED_STATUS = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED")
"""How a request must have ended for its turn to be saved: EOS or a stop id, ``max_tokens``, or
aborted (vLLM's front end aborts a request that met a stop *string*, and one whose client left;
the server keeps a turn only when the answer ended as asked, and sweeps what nobody took)."""


@dataclass
class SaveSpec:
    """One finished chat-memory turn to save: tokens ``[start, start + len(token_ids))`` from
    ``block_ids`` (the request's blocks, kept until the save is reported done) under ``turn``."""

    req_id: str
    turn: str
    start: int
    token_ids: list[int]
    block_ids: list[int]


def save_spec(request: Any, turn: str, outcome: dict | None, block_ids: Any) -> SaveSpec | None:
    """What to save of a finished ``request`` (vLLM's ``Request``) that carries ``turn``: the
    tokens after the ones loaded (``outcome["served"]``) up to the last one with K/V (the
    answer's last sampled token has none).

    Raises:
        KVEditError: it ended otherwise (an error, ignored) or its load was refused: nothing
            of it can be saved (the caller records why, so nobody waits for it).
    """
    status = getattr(request.status, "name", "")
    if status not in SAVED_STATUS:
        raise KVEditError(f"the request ended {status}: nothing to save")
    if outcome is not None and "refused" in outcome:
        raise KVEditError(f"its memory was refused ({outcome['refused']})")
    end = min(request.num_computed_tokens, request.num_tokens - 1)
    start = outcome.get("served", 0) if outcome is not None else 0
    ids = [int(t) for t in request.all_token_ids[start:end]]
    blocks = block_ids[0] if block_ids and isinstance(block_ids[0], list) else block_ids
    return SaveSpec(request.request_id, turn, start, ids, list(blocks))


@dataclass(frozen=True)
class SlotMap:
    """Where a layer's cache holds each ``(slot, kv head, dim)``: token ``t`` of block ``b`` is
    at flat offsets ``b * block_stride + keys[t]`` (its keys) and ``... + values[t]``.

    Attributes:
        keys: ``[block_size, kv_heads, head_dim]`` flat offsets (int64) of the keys in block 0.
        values: the same for the values.
        block_stride: flat elements between one block and the next.
    """

    keys: torch.Tensor
    values: torch.Tensor
    block_stride: int

    @property
    def block_size(self) -> int:
        return int(self.keys.shape[0])


def probe(
    write: Write, like: torch.Tensor, block_size: int, kv_heads: int, head_dim: int
) -> SlotMap:
    """The :class:`SlotMap` of caches shaped like ``like``, found by writing codes through
    ``write`` into a scratch tensor of its shape (``like`` itself is not touched).

    Raises:
        KVEditError: a dtype other than float32, a cache of fewer than two blocks, or a layout
            the codes do not read back from exactly.
    """
    if like.dtype != torch.float32:
        raise KVEditError(
            f"the save path reads float32 caches only (kvedit serve runs float32); this cache "
            f"is {like.dtype}"
        )
    per_block = block_size * kv_heads * head_dim
    if 2 * per_block + 1 >= CODE_LIMIT:
        raise KVEditError(f"a block of {per_block} entries is too large for the layout probe")
    if like.numel() < 2 * 2 * per_block:
        raise KVEditError("the layout probe needs a cache of at least two blocks")
    scratch = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    n = 2 * block_size  # blocks 0 and 1: their offsets give the block stride
    codes = torch.arange(1, n * kv_heads * head_dim + 1, dtype=torch.float32)
    codes = codes.view(n, kv_heads, head_dim).to(like.device)
    slots = torch.arange(n, device=like.device)
    write(codes.contiguous(), (-codes).contiguous(), scratch, slots)
    flat = scratch.reshape(-1).cpu()
    out = []
    for sign in (1, -1):
        where = torch.full((n * kv_heads * head_dim,), -1, dtype=torch.int64)
        found = torch.nonzero(flat * sign > 0).flatten()
        code = (flat[found] * sign).round().long() - 1
        if found.numel() != where.numel() or not bool(
            (code >= 0).all() and (code < where.numel()).all()
        ):
            raise KVEditError(
                f"the attention backend's cache layout could not be read back ({found.numel()} "
                f"of {where.numel()} probe codes found): kvedit cannot save from it"
            )
        where[code] = found
        out.append(where.view(n, kv_heads, head_dim))
    keys, values = out
    stride = keys[block_size:] - keys[:block_size]
    stride_v = values[block_size:] - values[:block_size]
    s = int(stride.flatten()[0])
    if not bool((stride == s).all() and (stride_v == s).all()) or s <= 0:
        raise KVEditError("the attention backend's blocks are not evenly strided: cannot save")
    return SlotMap(keys[:block_size].contiguous(), values[:block_size].contiguous(), s)


def gather(
    cache: torch.Tensor, slot_map: SlotMap, block_ids: Sequence[int], start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[start, end)`` of a request whose blocks are ``block_ids``, read from one
    layer's ``cache``: ``(keys, values)``, each ``[end - start, kv_heads, head_dim]`` on the CPU
    (copies: the blocks may be reused once the request is freed).

    Raises:
        KVEditError: a cache that is not one contiguous tensor, or tokens past the blocks.
    """
    if not cache.is_contiguous():
        raise KVEditError("the layer's cache is not contiguous: the save path cannot read it")
    bs = slot_map.block_size
    if start < 0 or end < start or (end - 1) // bs >= len(block_ids) and end > start:
        raise KVEditError(
            f"tokens [{start}, {end}) are not in the request's {len(block_ids)} blocks"
        )
    token = torch.arange(start, end)
    block = torch.tensor(list(block_ids), dtype=torch.int64)[token // bs]
    base = (block * slot_map.block_stride)[:, None, None]
    flat = cache.reshape(-1)
    device = cache.device
    keys = flat[(base + slot_map.keys[token % bs]).to(device)].cpu()
    values = flat[(base + slot_map.values[token % bs]).to(device)].cpu()
    return keys.contiguous(), values.contiguous()


@dataclass
class Saver:
    """The worker side of the save path: one layer's layout probed once per cache shape and
    backend, then every layer's rows of a request gathered."""

    block_size: int
    _maps: dict[tuple, SlotMap] = field(default_factory=dict)

    def slot_map(self, cache: torch.Tensor, layer: Any) -> SlotMap:
        """The layout of caches like ``cache`` written by ``layer.impl`` (probed once)."""
        key = (tuple(cache.shape), cache.dtype, type(layer.impl).__name__)
        if key not in self._maps:

            def write(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor):
                layer.impl.do_kv_cache_update(layer, k, v, kv, slots)

            self._maps[key] = probe(
                write, cache, self.block_size, layer.num_kv_heads, layer.head_size
            )
        return self._maps[key]

    def gather(
        self,
        caches: Mapping[str, torch.Tensor],
        layers: Mapping[str, Any],
        layer_index: Callable[[str], int],
        block_ids: Sequence[int],
        start: int,
        end: int,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Tokens ``[start, end)`` of every layer, in layer order: ``(keys, values)``, each a
        list of ``[end - start, kv_heads, head_dim]`` float32.

        Args:
            caches: ``{layer name: its paged cache}`` (what vLLM registered).
            layers: ``{layer name: its attention layer}`` (``impl``, ``num_kv_heads``,
                ``head_size``).
            layer_index: a layer name's decoder layer index.

        Raises:
            KVEditError: no caches, layers not numbered ``0..n-1``, or as :func:`probe` and
                :func:`gather`.
        """
        if not caches:
            raise KVEditError("vLLM registered no KV caches with the connector")
        names = sorted(caches, key=layer_index)
        if [layer_index(n) for n in names] != list(range(len(names))):
            raise KVEditError("the engine's attention layers are not numbered 0..n-1")
        keys, values = [], []
        for name in names:
            cache = caches[name]
            k, v = gather(cache, self.slot_map(cache, layers[name]), block_ids, start, end)
            keys.append(k.float())
            values.append(v.float())
        return keys, values
