"""The headwise cache layer: each KV head holds its own entries.

KVzip ranks every (layer, KV head, entry) together: a head that needs a token keeps it, a head
that reads nothing keeps little. To free the bytes that ranking drops, a layer must hold a
different set of entries on each head. :class:`HeadwiseLayerKV` does: slot ``j`` of head ``h``
holds the token ``head_index[h, j]``. Each head's entries are kept in token order and
*right-aligned* (the padding, where a head holds fewer than the longest, on the left), so the
newest entries, which every head holds, sit in the same slots on every head, and new entries
(the same tokens on every head) are appended after them.

Attention is exact per head through the one seam: padding slots hold zeros and a
:data:`PAD` bias (``exp`` of it is 0 in every float type), the layer's ``bias``
``[batch, kv_heads or heads, n]``. ``token_index`` and ``positions`` ``[n]`` keep their meaning
for a slot that holds the same token on every head (the appended tail, the last input) and are
``-1`` where the heads differ or pad: code that maps entries to text tokens sees only the
shared slots, so an edit (ops, focus, selection) refuses a state with headwise layers rather than
reach part of its entries (:func:`is_headwise`).

``nbytes`` counts what the layer allocates: keys, values (padding included), the bias and the
per-head bookkeeping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptCacheError, InvalidInputError
from .dense import LayerKV, right_aligned
from .registry import register_layer

__all__ = ["PAD", "HeadwiseLayerKV", "is_headwise", "keep_per_head", "refuse_headwise"]

PAD = -1e30
"""The bias of a padding slot: ``exp(-1e30)`` is exactly 0 in every float type, and it stays
finite under arithmetic (as :data:`kvedit.compress.DROPPED`)."""


@register_layer
@dataclass(eq=False, frozen=True)
class HeadwiseLayerKV(LayerKV):
    """A global layer whose KV heads hold different entries (module docstring).

    Attributes:
        head_index: ``[kv_heads, n]`` long, the token each head's slot holds (``-1``: padding).
        head_positions: ``[kv_heads, n]`` long, the rotary position of each slot's entry.
        token_index, positions: ``[n]``, a slot's token and position where every head holds
            the same one, else ``-1``.
    """

    kind: ClassVar[str] = "headwise"
    head_index: torch.Tensor | None = None
    head_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.head_index is None or self.head_positions is None:
            raise ValueError("HeadwiseLayerKV needs head_index and head_positions")
        if self.window is not None:
            raise ValueError("sliding-window layers are never headwise")

    @property
    def nbytes(self) -> int:
        tensors = (self.keys, self.values, self.bias, self.head_index, self.head_positions)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def held(self) -> torch.Tensor:
        """``[kv_heads, n]`` bool: the slots that hold an entry (not padding)."""
        return self.head_index >= 0

    def head_entries(self) -> int:
        return int(self.held().sum())

    def held_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.held()
        return self.head_index[held], self.head_positions[held]

    def map(self, fn) -> LayerKV:
        return dataclasses.replace(
            super().map(fn), head_index=fn(self.head_index), head_positions=fn(self.head_positions)
        )

    def to_tensors(self, cast=None) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, params = super().to_tensors(cast)
        tensors["head_index"] = self.head_index.to("cpu").contiguous()
        tensors["head_positions"] = self.head_positions.to("cpu").contiguous()
        return tensors, params

    @classmethod
    def from_tensors(cls, tensors, params, window, device, dtype) -> LayerKV:
        try:
            head_index, head_positions = tensors["head_index"], tensors["head_positions"]
        except KeyError as e:
            raise CorruptCacheError(f"a headwise layer lacks tensor {e}") from e
        base = LayerKV.from_tensors(tensors, params, window, device, dtype)
        n, heads = len(base), base.kv_shape[1]
        if head_index.shape != (heads, n) or head_positions.shape != (heads, n):
            raise CorruptCacheError(
                f"a headwise layer's head_index {tuple(head_index.shape)} does not match its "
                f"{heads} KV heads of {n} slots"
            )
        if base.bias is None or bool((base.dense_bias(heads)[0][head_index < 0] > PAD / 2).any()):
            raise CorruptCacheError("a headwise layer's padding is not masked")
        return _headwise(base, head_index, head_positions)

    def select(self, entries: torch.Tensor | slice) -> LayerKV:
        """This layer holding only the slots ``entries`` (every head's)."""
        plain = super().select(entries)
        m = entries.to(self.head_index.device) if isinstance(entries, torch.Tensor) else entries
        return _headwise(plain, self.head_index[:, m], self.head_positions[:, m])

    def append(self, keys, values, token_index, positions, bias=None) -> LayerKV:
        """New entries (the same tokens on every head) appended after the last slot."""
        plain = LayerKV.append(self, keys, values, token_index, positions, bias)
        return self._grown(plain, token_index, positions)

    def extended(self, full_keys, full_values, token_index, positions) -> LayerKV:
        plain = LayerKV.extended(self, full_keys, full_values, token_index, positions)
        return self._grown(plain, token_index, positions)

    def longest_head(self) -> int:
        return int(self.held().sum(dim=1).max()) if self.held().numel() else 0

    def repositioned(self, end: int, move) -> LayerKV:
        """As :meth:`LayerKV.repositioned`, each KV head's entries right-aligned on their own
        (a padding slot keeps its position and its zero key)."""
        held = self.held()
        head_positions = self.head_positions.clone()
        for h in range(held.shape[0]):
            head_positions[h, held[h]] = right_aligned(self.head_positions[h, held[h]], end)
        delta = torch.where(held, head_positions - self.head_positions, 0)
        keys = torch.cat(
            [move(self.keys[:, h : h + 1], delta[h]) for h in range(delta.shape[0])], dim=1
        )
        plain = dataclasses.replace(LayerKV.select(self, slice(None)), keys=keys)
        return _headwise(plain, self.head_index, head_positions)

    def _grown(self, plain: LayerKV, token_index, positions) -> LayerKV:
        heads = self.head_index.shape[0]
        new_index = token_index.to(self.head_index.device)[None].expand(heads, -1)
        new_pos = positions.to(self.head_positions.device)[None].expand(heads, -1)
        return _headwise(
            plain,
            torch.cat([self.head_index, new_index], dim=1),
            torch.cat([self.head_positions, new_pos], dim=1),
        )


def _headwise(plain: LayerKV, head_index: torch.Tensor, head_positions: torch.Tensor) -> LayerKV:
    """A headwise layer over ``plain``'s K/V and bias with these per-head slots (its shared
    ``token_index``/``positions`` recomputed); a plain layer when every head holds the same
    entries and nothing pads."""
    same = (head_index == head_index[:1]).all(dim=0) & (head_positions == head_positions[:1]).all(
        dim=0
    )
    if bool(same.all()) and bool((head_index >= 0).all()):
        return LayerKV(
            keys=plain.keys,
            values=plain.values,
            token_index=head_index[0].clone(),
            positions=head_positions[0].clone(),
            bias=_unpadded(plain.bias),
            window=plain.window,
        )
    shared = same & (head_index[0] >= 0)
    none = torch.full_like(head_index[0], -1)
    return HeadwiseLayerKV(
        keys=plain.keys,
        values=plain.values,
        token_index=torch.where(shared, head_index[0], none),
        positions=torch.where(shared, head_positions[0], none),
        bias=plain.bias,
        window=None,
        head_index=head_index,
        head_positions=head_positions,
    )


def _unpadded(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``bias`` without a padding mask to carry (None when it held only zeros)."""
    if bias is None or bool((bias != 0).any()):
        return bias
    return None


def is_headwise(layer: LayerKV) -> bool:
    """Whether ``layer``'s KV heads hold different entries."""
    return isinstance(layer, HeadwiseLayerKV)


def refuse_headwise(layers, what: str) -> None:
    """Refuse, before any work, to run ``what`` over layers of which one is headwise: it maps
    entries to text tokens through ``token_index``, which names only the slots every head
    shares, so it would reach part of the entries without a word.

    Raises:
        InvalidInputError: naming ``what`` and the layer.
    """
    for i, layer in enumerate(layers):
        if is_headwise(layer):
            raise InvalidInputError(
                f"{what} needs the same entries on every KV head, but layer {i} holds them per "
                "head (a memory that forgot per head, kvedit.cache.headwise); make the memory "
                "with per_head=False to edit, focus, compress or serve its cache"
            )


def keep_per_head(layer: LayerKV, kept: torch.Tensor) -> LayerKV:
    """``layer`` holding, on each KV head ``h``, only the slots ``kept[h]`` that hold an entry.

    Args:
        layer: a dense or headwise global layer (not modified).
        kept: ``[kv_heads, n]`` bool.

    Returns:
        Each head's kept entries in order, right-aligned (module docstring): a
        :class:`HeadwiseLayerKV`, or a plain layer when every head keeps the same slots.
    """
    if layer.packed or layer.window is not None:
        raise ValueError("only dense global layers are held per head")
    heads = layer.kv_shape[1]
    index = layer.head_index if is_headwise(layer) else layer.token_index[None].expand(heads, -1)
    pos = layer.head_positions if is_headwise(layer) else layer.positions[None].expand(heads, -1)
    kept = kept.to(index.device) & (index >= 0)
    counts = kept.sum(dim=1)
    width = int(counts.max()) if heads else 0
    # slot order: per head, its kept slots in order, right-aligned into `width` columns
    rank = torch.cumsum(kept.long(), dim=1) - 1 + (width - counts)[:, None]
    src = torch.zeros(heads, width, dtype=torch.long, device=index.device)
    filled = torch.zeros(heads, width, dtype=torch.bool, device=index.device)
    rows = torch.arange(heads, device=index.device)[:, None].expand_as(kept)
    src[rows[kept], rank[kept]] = torch.arange(index.shape[1], device=index.device)[None].expand_as(
        kept
    )[kept]
    filled[rows[kept], rank[kept]] = True
    gather = src.to(layer.keys.device)[None, :, :, None]
    keys = torch.gather(layer.keys, 2, gather.expand(layer.kv_shape[0], -1, -1, layer.kv_shape[3]))
    vdim = layer.value_shape[3]
    values = torch.gather(layer.values, 2, gather.expand(layer.kv_shape[0], -1, -1, vdim))
    pad = ~filled.to(layer.keys.device)
    keys = keys.masked_fill(pad[None, :, :, None], 0)
    values = values.masked_fill(pad[None, :, :, None], 0)
    bias = _gathered_bias(layer, src, pad)
    head_index = torch.where(filled, torch.gather(index, 1, src), torch.full_like(src, -1))
    head_positions = torch.where(filled, torch.gather(pos, 1, src), torch.full_like(src, -1))
    plain = LayerKV(
        keys=keys, values=values, token_index=head_index[0], positions=head_positions[0]
    )
    return _headwise(dataclasses.replace(plain, bias=bias), head_index, head_positions)


def _gathered_bias(layer: LayerKV, src: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads or heads, width]``: ``layer``'s bias at each head's slots ``src``
    ``[kv_heads, width]``, :data:`PAD` where ``pad``."""
    heads = src.shape[0]
    bias = layer.dense_bias()  # [batch, kv_heads or query heads, n]
    group = bias.shape[1] // heads
    cols = src.to(bias.device).repeat_interleave(group, dim=0)[None].expand(bias.shape[0], -1, -1)
    out = torch.gather(bias, 2, cols).float()
    return out.masked_fill(pad.to(out.device).repeat_interleave(group, dim=0)[None], PAD)
