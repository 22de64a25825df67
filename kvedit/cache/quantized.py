"""The quantized cache layer: KIVI-style packed keys (per channel) and values (per token).

See :func:`kvedit.ops.quantize` for how a state gets these layers. Shapes as
:class:`~kvedit.cache.LayerKV`; packed data as :class:`PackedKV` documents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptCacheError
from .dense import LayerKV
from .registry import register_layer

BITS = (2, 4, 8)
_F16_MAX = 6.0e4


@dataclass(eq=False)
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

    def appended(self, new: torch.Tensor) -> PackedKV:
        """Entries ``new [b, h, k, d]`` added to the full-precision residual."""
        residual = torch.cat([self.residual, new.to(self.residual.dtype)], dim=-2)
        return dataclasses.replace(self, residual=residual)

    def map(self, fn) -> PackedKV:
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
    per = 8 // bits
    if per == 1:
        return codes
    shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
    lanes = codes.reshape(*codes.shape[:-1], -1, per) << shifts
    return lanes.sum(dim=-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    lanes = (packed[..., None] >> shifts) & (2**bits - 1)
    return lanes.reshape(*packed.shape[:-1], d)


@register_layer
@dataclass(init=False, repr=False, eq=False)
class QuantizedLayerKV(LayerKV):
    """A global layer whose keys and values are stored packed (:class:`PackedKV`).

    ``keys`` and ``values`` are dequantized on every access. Constructed from packed data, or,
    as other ops do (``dataclasses.replace(layer, keys=k)``), from dense ``keys``/``values``
    and the packed data they replace: changed tensors are quantized the way the packed data
    was, unchanged ones (exactly its dequantization) keep it.
    """

    kind: ClassVar[str] = "quantized"
    lossless: ClassVar[bool] = False
    packed: ClassVar[bool] = True
    packed_keys: PackedKV | None = None
    packed_values: PackedKV | None = None

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        window: int | None = None,
        packed_keys: PackedKV | None = None,
        packed_values: PackedKV | None = None,
    ):
        if packed_keys is None or packed_values is None:
            raise ValueError("QuantizedLayerKV needs packed keys and values; use ops.quantize")
        if window is not None:
            raise ValueError("sliding-window layers are not quantized")
        if token_index is None or positions is None:
            raise ValueError("QuantizedLayerKV needs token_index and positions")
        self.packed_keys = packed_keys if keys is None else packed_keys.requantized(keys)
        self.packed_values = packed_values if values is None else packed_values.requantized(values)
        self.token_index = token_index
        self.positions = positions
        self.bias = bias
        self.window = None

    @property
    def keys(self) -> torch.Tensor:
        return self.packed_keys.dequantize()

    @property
    def values(self) -> torch.Tensor:
        return self.packed_values.dequantize()

    def __len__(self) -> int:
        return self.packed_keys.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.packed_keys.codes.device

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return self.packed_keys.shape

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        return self.packed_values.shape

    def dense_kv(self, new_keys=None, new_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values dequantized (``[batch, kv_heads, n (+ k), head_dim]``),
        ``new_keys`` / ``new_values`` appended when given."""
        return self.packed_keys.dequantize(new_keys), self.packed_values.dequantize(new_values)

    def to_tensors(self, cast=None) -> tuple[dict[str, torch.Tensor], dict]:
        """Packed: codes, scales and zero points as they are, the exact residual (cast)."""
        cast = cast or (lambda t, what: t)
        out: dict[str, torch.Tensor] = {}
        for name, p in (("keys", self.packed_keys), ("values", self.packed_values)):
            out[f"{name}.codes"] = p.codes.to("cpu").contiguous()
            out[f"{name}.scale"] = p.scale.to("cpu").contiguous()
            out[f"{name}.zero"] = p.zero.to("cpu").contiguous()
            out[f"{name}.residual"] = cast(p.residual.to("cpu").contiguous(), name)
        params = {
            "bits": self.packed_keys.bits,
            "key_group": self.packed_keys.group,
            "value_group": self.packed_values.group,
        }
        return self._bookkeeping(out), params

    @classmethod
    def from_tensors(cls, tensors, params, window, device, dtype) -> QuantizedLayerKV:
        try:
            bits = int(params["bits"])
            groups = {"keys": int(params["key_group"]), "values": int(params["value_group"])}
            packed = {
                name: PackedKV(
                    codes=tensors[f"{name}.codes"].to(device),
                    scale=tensors[f"{name}.scale"].to(device),
                    zero=tensors[f"{name}.zero"].to(device),
                    residual=tensors[f"{name}.residual"].to(device, dtype),
                    bits=bits,
                    group=groups[name],
                    axis="channel" if name == "keys" else "token",
                )
                for name in ("keys", "values")
            }
            bias = tensors.get("bias")
            return cls(
                token_index=tensors["token_index"],
                positions=tensors["positions"],
                bias=None if bias is None else bias.to(device),
                window=window,
                packed_keys=packed["keys"],
                packed_values=packed["values"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCacheError(f"a quantized layer is malformed: {e}") from e

    def __repr__(self) -> str:
        pk = self.packed_keys
        return f"QuantizedLayerKV(n={len(self)}, bits={pk.bits}, exact={pk.residual.shape[-2]})"

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed_keys.nbytes + self.packed_values.nbytes + bias

    def _with(self, new_keys, new_values, token_index, positions, bias) -> QuantizedLayerKV:
        return QuantizedLayerKV(
            token_index=token_index,
            positions=positions,
            bias=bias,
            packed_keys=self.packed_keys.appended(new_keys),
            packed_values=self.packed_values.appended(new_values),
        )

    def map(self, fn) -> QuantizedLayerKV:
        return QuantizedLayerKV(
            token_index=fn(self.token_index),
            positions=fn(self.positions),
            bias=None if self.bias is None else fn(self.bias),
            packed_keys=self.packed_keys.map(fn),
            packed_values=self.packed_values.map(fn),
        )

    def select(self, entries: torch.Tensor | slice) -> LayerKV:
        """The layer holding only ``entries``: still packed when they keep the whole packed
        part in order (a cut of the full-precision residual), else a dense layer."""
        n = len(self)
        idx = torch.arange(n)[entries] if isinstance(entries, slice) else entries.cpu()
        n_quant = self.packed_keys.n_quant
        rest = idx[n_quant:] - n_quant
        if idx.numel() < n_quant or not torch.equal(idx[:n_quant], torch.arange(n_quant)):
            return super().select(entries)
        if rest.numel() and int(rest.min()) < 0:
            return super().select(entries)
        pk, pv = self.packed_keys, self.packed_values
        r = rest.to(pk.residual.device)
        return QuantizedLayerKV(
            token_index=self.token_index[idx],
            positions=self.positions[idx],
            bias=None if self.bias is None else self.bias[..., idx.to(self.bias.device)],
            packed_keys=dataclasses.replace(pk, residual=pk.residual[:, :, r]),
            packed_values=dataclasses.replace(pv, residual=pv.residual[:, :, r]),
        )

    def append(self, keys, values, token_index, positions, bias=None) -> QuantizedLayerKV:
        """Entries appended to the full-precision residual (bias as :meth:`LayerKV.append`);
        the packed part is neither expanded nor re-quantized."""
        index, pos, new_bias = self.appended_bookkeeping(
            keys.shape[-2], token_index, positions, bias
        )
        return self._with(keys, values, index, pos, new_bias)

    def extended(self, full_keys, full_values, token_index, positions) -> QuantizedLayerKV:
        """The new entries of ``full_keys/values`` (after this layer's) appended exactly."""
        n = len(self)
        bias = self.bias
        if bias is not None:
            bias = torch.nn.functional.pad(bias, (0, full_keys.shape[-2] - n))
        return self._with(
            full_keys[:, :, n:],
            full_values[:, :, n:],
            torch.cat([self.token_index, token_index.to(self.token_index.device)]),
            torch.cat([self.positions, positions.to(self.positions.device)]),
            bias,
        )
