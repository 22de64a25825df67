"""The dense cache layer: one decoder layer's K/V entries as plain tensors.

Shapes: keys and values ``[batch, kv_heads, n, head_dim]``; ``token_index`` and ``positions``
``[n]``; ``bias`` ``[batch, kv_heads or heads, n]`` in nats (or None for zeros).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptCacheError
from .registry import register_layer


@register_layer
@dataclass(eq=False, frozen=True)
class LayerKV:
    """One decoder layer's cache entries.

    Attributes:
        keys: ``[batch, kv_heads, n, head_dim]`` post-RoPE keys.
        values: ``[batch, kv_heads, n, head_dim]``.
        token_index: ``[n]`` index into the state's tokens of the token each entry encodes.
        positions: ``[n]`` rotary position each entry was encoded at.
        bias: ``[batch, kv_heads or heads, n]`` additive logit bias in nats, or None for zeros.
        window: the layer's sliding window, or None for global attention.

    ``==`` is identity (tensors have no single truth value); compare tensors explicitly.

    Frozen: setting an attribute raises :class:`dataclasses.FrozenInstanceError`; every edit
    returns a new layer (``dataclasses.replace``, :meth:`map`, :meth:`append`, ...). The
    attributes are frozen, not the data: the tensors themselves are not write-protected, and
    no kvedit function writes into a layer's tensors.
    """

    kind: ClassVar[str] = "dense"
    lossless: ClassVar[bool] = True  # holds exactly what the model computed
    packed: ClassVar[bool] = False
    """Whether the layer holds its K/V in a packed form that :meth:`dense_kv` expands: a
    forward then expands it when its attention runs and drops it after
    (:func:`kvedit.cache.adapter.dynamic_cache`), instead of holding the dense K/V."""

    keys: torch.Tensor
    values: torch.Tensor
    token_index: torch.Tensor
    positions: torch.Tensor
    bias: torch.Tensor | None = None
    window: int | None = None

    def __len__(self) -> int:
        return self.keys.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """``(batch, kv_heads, n, head_dim)`` of the keys (read without expanding a packed layer)."""
        return tuple(self.keys.shape)

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The values' shape ``(batch, kv_heads, n, value_dim)``, read as :attr:`kv_shape`
        (the value head size may differ from the keys', e.g. MLA)."""
        return tuple(self.values.shape)

    def dense_kv(
        self, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` as dense ``[batch, kv_heads, n (+ k), head_dim]`` tensors, for the
        attention (a packed layer materializes only this layer), followed by ``new_keys`` /
        ``new_values`` ``[batch, kv_heads, k, head_dim]`` when given (one concatenation)."""
        if new_keys is None:
            return self.keys, self.values
        return (
            torch.cat([self.keys, new_keys.to(self.keys.dtype)], dim=-2),
            torch.cat([self.values, new_values.to(self.values.dtype)], dim=-2),
        )

    def shared_tensors(self, cast=None) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Tensors this layer shares with other layers of its state, as ``(key, tensors)``
        (a merged pair's directions, :mod:`kvedit.cache.directions`), or None (the default).

        Storage writes each key's tensors once, as ``shared.{key}.NAME``, and hands them back
        to :meth:`from_tensors` as ``shared.NAME`` for every layer whose params name the key
        under ``"shared"``. ``cast`` as :meth:`to_tensors`.
        """
        return None

    def to_tensors(self, cast=None) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors by name, JSON params)`` to store this layer (on CPU, contiguous).

        ``cast(tensor, what)``, when given, converts the float K/V data (storage's dtype).
        """
        cast = cast or (lambda t, what: t)
        out = {
            "keys": cast(self.keys.to("cpu").contiguous(), "keys"),
            "values": cast(self.values.to("cpu").contiguous(), "values"),
        }
        return self._bookkeeping(out), {}

    def _bookkeeping(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out["token_index"] = self.token_index.to("cpu").contiguous()
        out["positions"] = self.positions.to("cpu").contiguous()
        if self.bias is not None:
            out["bias"] = self.bias.to("cpu", torch.float32).contiguous()
        return out

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        params: dict,
        window: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> LayerKV:
        """The layer :meth:`to_tensors` wrote, K/V on ``device`` in ``dtype``."""
        try:
            bias = tensors.get("bias")
            return cls(
                keys=tensors["keys"].to(device, dtype),
                values=tensors["values"].to(device, dtype),
                token_index=tensors["token_index"],
                positions=tensors["positions"],
                bias=None if bias is None else bias.to(device),
                window=window,
            )
        except KeyError as e:
            raise CorruptCacheError(f"a {cls.kind} layer lacks tensor {e}") from e

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: keys, values and bias (compressed layers report their own)."""
        tensors = (self.keys, self.values, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def head_entries(self) -> int:
        """Entries held over all KV heads (``kv_heads * n``; a headwise layer counts each
        head's own, :mod:`kvedit.cache.headwise`)."""
        return self.kv_shape[1] * len(self)

    def held_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_index, positions)`` of every entry the layer holds, flat (a headwise layer
        lists each head's own, :mod:`kvedit.cache.headwise`)."""
        return self.token_index, self.positions

    def entries_for(self, token_indices: torch.Tensor) -> torch.Tensor:
        """Entry indices of this layer that encode any of ``token_indices`` (``LongTensor[k]``)."""
        return (
            torch.isin(self.token_index, token_indices.to(self.token_index.device))
            .nonzero()
            .flatten()
        )

    def dense_bias(self, heads: int | None = None) -> torch.Tensor:
        """The bias as a tensor ``[batch, heads or kv_heads, n]`` (zeros when unset)."""
        if self.bias is not None and (heads is None or self.bias.shape[1] == heads):
            return self.bias
        b, hkv, n, _ = self.kv_shape
        base = (
            self.bias
            if self.bias is not None
            else torch.zeros(b, hkv, n, dtype=torch.float32, device=self.device)
        )
        if heads is None or heads == base.shape[1]:
            return base
        return base.repeat_interleave(heads // base.shape[1], dim=1)

    def map(self, fn) -> LayerKV:
        """A copy with ``fn`` applied to every tensor."""
        return dataclasses.replace(
            self,
            keys=fn(self.keys),
            values=fn(self.values),
            token_index=fn(self.token_index),
            positions=fn(self.positions),
            bias=None if self.bias is None else fn(self.bias),
        )

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> LayerKV:
        """A new layer with entries appended (bias zeros unless given), then trimmed to the window."""
        token_index, positions, new_bias = self.appended_bookkeeping(
            keys.shape[-2], token_index, positions, bias
        )
        out = LayerKV(
            keys=torch.cat([self.keys, keys.to(self.keys.dtype)], dim=-2),
            values=torch.cat([self.values, values.to(self.values.dtype)], dim=-2),
            token_index=token_index,
            positions=positions,
            bias=new_bias,
            window=self.window,
        )
        return out.trimmed()

    def appended_bookkeeping(
        self,
        n_new: int,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(token_index [n + n_new], positions [n + n_new], bias)`` of this layer with
        ``n_new`` entries appended (bias as :meth:`append`), without touching K/V."""
        if self.bias is None and bias is None:
            new_bias = None
        else:
            heads = max(
                self.bias.shape[1] if self.bias is not None else 1,
                bias.shape[1] if bias is not None else 1,
            )
            old = self.dense_bias(heads if heads > 1 else None)
            add = (
                bias
                if bias is not None
                else torch.zeros(old.shape[0], old.shape[1], n_new, device=old.device)
            )
            if add.shape[1] != old.shape[1]:
                add = add.repeat_interleave(old.shape[1] // add.shape[1], dim=1)
            new_bias = torch.cat([old, add.to(old.dtype)], dim=-1)
        return (
            torch.cat([self.token_index, token_index.to(self.token_index.device)]),
            torch.cat([self.positions, positions.to(self.positions.device)]),
            new_bias,
        )

    def extended(
        self,
        full_keys: torch.Tensor,
        full_values: torch.Tensor,
        token_index: torch.Tensor,
        positions: torch.Tensor,
    ) -> LayerKV:
        """A new layer whose K/V are ``full_keys/values`` ``[batch, kv_heads, len + n, dim]``:
        this layer's entries followed by ``n`` new ones (zero bias), trimmed to the window."""
        n_new = full_keys.shape[-2] - len(self)
        bias = self.bias
        if bias is not None:
            bias = torch.nn.functional.pad(bias, (0, n_new))
        return LayerKV(
            keys=full_keys,
            values=full_values,
            token_index=torch.cat([self.token_index, token_index.to(self.token_index.device)]),
            positions=torch.cat([self.positions, positions.to(self.positions.device)]),
            bias=bias,
            window=self.window,
        ).trimmed()

    def select(self, entries: torch.Tensor | slice) -> LayerKV:
        """A dense layer holding only ``entries`` (indices or a slice of this layer's entries)."""
        e = entries.to(self.keys.device) if isinstance(entries, torch.Tensor) else entries
        m = entries.to(self.token_index.device) if isinstance(entries, torch.Tensor) else entries
        return LayerKV(  # a plain (dense) layer, also when this one is a subclass
            keys=self.keys[:, :, e],
            values=self.values[:, :, e],
            token_index=self.token_index[m],
            positions=self.positions[m],
            bias=None if self.bias is None else self.bias[..., e],
            window=self.window,
        )

    def longest_head(self) -> int:
        """The most entries one KV head holds (every head holds all of a dense layer's)."""
        return len(self)

    def repositioned(self, end: int, move) -> LayerKV:
        """This layer with its entries at consecutive positions ending at ``end - 1``, in the
        order of their positions (right-aligned: every layer's newest entry at ``end - 1``),
        the keys moved there by ``move(keys, delta)`` (keys ``[batch, kv_heads, n, head_dim]``,
        ``delta`` ``[n]``: a :class:`~kvedit.rope.KeyMover`'s ``move``). A packed layer refuses
        (its keys would be unpacked and packed again): callers check :attr:`packed` first."""
        if self.packed:
            raise TypeError(f"a {self.kind} layer's keys cannot be moved without repacking")
        positions = right_aligned(self.positions, end)
        keys = move(self.keys, positions - self.positions)
        return dataclasses.replace(self, keys=keys, positions=positions)

    def trimmed(self) -> LayerKV:
        """Keep only the last ``window`` entries on a sliding-window layer."""
        if self.window is None or len(self) <= self.window:
            return self
        return self.select(slice(len(self) - self.window, None))


def right_aligned(positions: torch.Tensor, end: int) -> torch.Tensor:
    """``[n]`` new positions for entries at ``positions`` ``[n]``: consecutive, in the same
    order, the last at ``end - 1``."""
    n = positions.shape[0]
    rank = torch.empty_like(positions)
    rank[torch.argsort(positions, stable=True)] = torch.arange(n, device=positions.device)
    return end - n + rank
