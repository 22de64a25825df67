"""Packed K/V: the data format and the layer base that quantized and merged layers share.

:class:`PackedKV` holds a ``[batch, heads, n, dim]`` tensor as KIVI-style low-bit codes (its
first ``n_quant`` entries) followed by an exact residual; :func:`packed_kv_tensors` and
:func:`load_packed_kv` write and read a keys/values pair of them (the one on-disk layout of
packed data: ``{keys,values}.{codes,scale,zero,residual}``).

:class:`PackedLayerKV` is the base of the layer kinds whose entries are a packed part followed
by an exact tail (``packed = True``): quantized (:mod:`.quantized`) and merged (:mod:`.merged`).
It selects entries (:meth:`PackedLayerKV.select`) and appends them (:meth:`~PackedLayerKV.append`,
:meth:`~PackedLayerKV.extended`) the same way for both, through the tail.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .dense import LayerKV

__all__ = [
    "BITS",
    "PackedKV",
    "PackedLayerKV",
    "load_packed_kv",
    "pack_codes",
    "packed_kv_tensors",
    "unpack_codes",
]

BITS = (2, 4, 8)
"""The bit widths codes are packed at."""

_F16_MAX = 6.0e4
_AXES = {"keys": "channel", "values": "token"}
"""How keys (per channel, over groups of entries) and values (per entry) are quantized."""

Cast = Callable[[torch.Tensor, str], torch.Tensor]


@dataclass(eq=False, frozen=True)
class PackedKV:
    """A ``[batch, heads, n, dim]`` tensor: ``n_quant`` leading entries as packed codes, the
    rest in full precision.

    Attributes:
        codes: ``uint8 [batch, heads, n_quant, dim * bits // 8]``, ``8 // bits`` codes a byte.
        scale, zero: float16/32; ``[batch, heads, n_quant // group, 1, dim]`` for
            ``axis="channel"`` (keys), ``[batch, heads, n_quant, dim // group, 1]`` for
            ``axis="token"`` (values). ``x ~ code * scale + zero``.
        residual: ``[batch, heads, n - n_quant, dim]`` entries kept exact.
        bits, group, axis: how it was quantized.

    Frozen (the attributes, not the tensors' data): :meth:`with_residual` and :meth:`map`
    return new objects.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    residual: torch.Tensor
    bits: int
    group: int
    axis: str

    @property
    def n_quant(self) -> int:
        return self.codes.shape[-2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, r, d = self.residual.shape
        return b, h, self.n_quant + r, d

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scale, self.zero, self.residual)
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def quantize(cls, x: torch.Tensor, bits: int, group: int, n_quant: int, axis: str) -> PackedKV:
        """Quantize the first ``n_quant`` entries of ``x [b, h, n, d]`` (a multiple of ``group``
        for ``axis="channel"``); keep the rest exact."""
        b, h, _, d = x.shape
        head = x[:, :, :n_quant].float()
        grouped = _grouped(head, group, axis)
        reduce = -2 if axis == "channel" else -1
        lo = grouped.amin(dim=reduce, keepdim=True)
        hi = grouped.amax(dim=reduce, keepdim=True)
        meta_dtype = torch.float16 if x.numel() == 0 or x.abs().max() < _F16_MAX else torch.float32
        qmax = 2**bits - 1
        scale = ((hi - lo) / qmax).clamp_min(1e-5).to(meta_dtype)
        zero = lo.to(meta_dtype)
        codes = ((grouped - zero.float()) / scale.float()).round().clamp(0, qmax)
        codes = codes.to(torch.uint8).reshape(b, h, n_quant, d)
        return cls(
            pack_codes(codes, bits), scale, zero, x[:, :, n_quant:].clone(), bits, group, axis
        )

    def dequantize(self, extra: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``[batch, heads, n (+ k), dim]`` in the residual's dtype, followed by
        ``extra [batch, heads, k, dim]`` when given (in the same concatenation)."""
        b, h, _, d = self.residual.shape
        codes = unpack_codes(self.codes, self.bits, d).float()
        head = _grouped(codes, self.group, self.axis) * self.scale.float() + self.zero.float()
        head = head.reshape(b, h, self.n_quant, d).to(self.residual.dtype)
        parts = [head, self.residual]
        if extra is not None:
            parts.append(extra.to(self.residual.dtype))
        return torch.cat(parts, dim=-2)

    def requantized(self, x: torch.Tensor) -> PackedKV:
        """``x`` quantized the same way (same bits, group, axis and quantized length).

        When ``x`` is exactly this tensor's dequantization (``dataclasses.replace`` passes the
        dequantized keys back), the packed data is kept, moved to ``x``'s device if needed.
        """
        if tuple(x.shape) == self.shape and x.dtype == self.residual.dtype:
            current = self.dequantize().to(x.device)
            if torch.equal(current, x):
                return self if x.device == self.codes.device else self.map(lambda t: t.to(x.device))
        n_quant = self.n_quant if x.shape[-2] >= self.n_quant else 0
        return PackedKV.quantize(x, self.bits, self.group, n_quant, self.axis)

    def with_residual(self, residual: torch.Tensor) -> PackedKV:
        """The same packed part followed by ``residual [batch, heads, r, dim]`` (exact)."""
        return dataclasses.replace(self, residual=residual)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedKV:
        """A copy with ``fn`` applied to every tensor."""
        return dataclasses.replace(
            self,
            codes=fn(self.codes),
            scale=fn(self.scale),
            zero=fn(self.zero),
            residual=fn(self.residual),
        )


def _grouped(x: torch.Tensor, group: int, axis: str) -> torch.Tensor:
    """``[b, h, n, d]`` -> 5D with the quantization group as one axis."""
    b, h, n, d = x.shape
    if axis == "channel":
        return x.reshape(b, h, n // group, group, d)
    return x.reshape(b, h, n, d // group, group)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8 [..., d]`` codes below ``2**bits`` packed ``8 // bits`` to a byte:
    ``uint8 [..., d * bits // 8]``."""
    per = 8 // bits
    if per == 1:
        return codes
    shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
    lanes = codes.reshape(*codes.shape[:-1], -1, per) << shifts
    return lanes.sum(dim=-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: ``uint8 [..., d]``."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    lanes = (packed[..., None] >> shifts) & (2**bits - 1)
    return lanes.reshape(*packed.shape[:-1], d)


def packed_kv_tensors(
    keys: PackedKV, values: PackedKV, cast: Cast | None = None, what: str = ""
) -> dict[str, torch.Tensor]:
    """The tensors storing ``keys`` and ``values`` (on CPU, contiguous), named
    ``{keys,values}.{codes,scale,zero,residual}``; ``cast(tensor, f"{name}{what}")`` converts
    the exact residuals (storage's dtype)."""
    cast = cast or (lambda t, what: t)
    out: dict[str, torch.Tensor] = {}
    for name, p in (("keys", keys), ("values", values)):
        out[f"{name}.codes"] = p.codes.to("cpu").contiguous()
        out[f"{name}.scale"] = p.scale.to("cpu").contiguous()
        out[f"{name}.zero"] = p.zero.to("cpu").contiguous()
        out[f"{name}.residual"] = cast(p.residual.to("cpu").contiguous(), f"{name}{what}")
    return out


def load_packed_kv(
    tensors: dict[str, torch.Tensor],
    bits: int,
    groups: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[PackedKV, PackedKV]:
    """``(keys, values)`` as :func:`packed_kv_tensors` wrote them, on ``device``, the exact
    residuals in ``dtype``; ``groups`` is ``(key group, value group)``. A missing tensor
    raises ``KeyError``."""
    keys, values = (
        PackedKV(
            codes=tensors[f"{name}.codes"].to(device),
            scale=tensors[f"{name}.scale"].to(device),
            zero=tensors[f"{name}.zero"].to(device),
            residual=tensors[f"{name}.residual"].to(device, dtype),
            bits=bits,
            group=group,
            axis=_AXES[name],
        )
        for name, group in zip(("keys", "values"), groups, strict=True)
    )
    return keys, values


class PackedLayerKV(LayerKV, ABC):
    """Base of the packed layer kinds: ``n_packed`` leading entries held packed, then an exact
    tail ``[batch, kv_heads, n - n_packed, head_dim]`` to which new entries are appended.

    A subclass gives its packed length (:attr:`n_packed`), its exact tail (:attr:`tail`) and
    the same layer with other bookkeeping and another tail (:meth:`with_tail`); selection and
    appending are then shared. Not registered: it has no ``kind`` of its own.

    Frozen like :class:`LayerKV`: a subclass's own ``__init__`` sets its fields once, through
    :meth:`_init_fields`.
    """

    lossless: ClassVar[bool] = False
    packed: ClassVar[bool] = True

    def _init_fields(self, **fields: object) -> None:
        """Set the fields of a layer being constructed (a frozen dataclass with its own
        ``__init__`` has no other way); never called on a finished layer."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    @abstractmethod
    def n_packed(self) -> int:
        """Entries in the packed part (the tail follows them)."""

    @property
    @abstractmethod
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact tail: keys and values ``[batch, kv_heads, n - n_packed, head_dim]``."""

    @abstractmethod
    def with_tail(
        self,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None,
        tail_keys: torch.Tensor,
        tail_values: torch.Tensor,
    ) -> PackedLayerKV:
        """This layer's packed part followed by ``tail_keys`` / ``tail_values``
        ``[batch, kv_heads, t, head_dim]``, with ``token_index`` and ``positions`` ``[n_packed
        + t]`` and ``bias`` ``[batch, kv_heads or heads, n_packed + t]`` (or None)."""

    def select(self, entries: torch.Tensor | slice) -> LayerKV:
        """The layer holding only ``entries``: still packed when they keep the whole packed
        part in order (a cut of the exact tail), else a dense layer."""
        idx = torch.arange(len(self))[entries] if isinstance(entries, slice) else entries.cpu()
        m = self.n_packed
        if idx.numel() < m or not torch.equal(idx[:m], torch.arange(m)):
            return super().select(entries)
        rest = idx[m:] - m
        if rest.numel() and int(rest.min()) < 0:
            return super().select(entries)
        keys, values = self.tail
        r = rest.to(keys.device)
        return self.with_tail(
            self.token_index[idx],
            self.positions[idx],
            None if self.bias is None else self.bias[..., idx.to(self.bias.device)],
            keys[:, :, r],
            values[:, :, r.to(values.device)],
        )

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> PackedLayerKV:
        """Entries ``[batch, kv_heads, k, head_dim]`` appended to the exact tail (bias as
        :meth:`LayerKV.append`); the packed part is neither expanded nor re-packed."""
        index, pos, new_bias = self.appended_bookkeeping(
            keys.shape[-2], token_index, positions, bias
        )
        tail_keys, tail_values = self.tail
        return self.with_tail(
            index,
            pos,
            new_bias,
            torch.cat([tail_keys, keys.to(tail_keys.dtype)], dim=-2),
            torch.cat([tail_values, values.to(tail_values.dtype)], dim=-2),
        )

    def extended(
        self,
        full_keys: torch.Tensor,
        full_values: torch.Tensor,
        token_index: torch.Tensor,
        positions: torch.Tensor,
    ) -> PackedLayerKV:
        """The new entries of ``full_keys/values`` ``[batch, kv_heads, len + k, head_dim]``
        (after this layer's) appended exactly, with a zero bias."""
        n = len(self)
        return self.append(full_keys[:, :, n:], full_values[:, :, n:], token_index, positions)
