"""The quantized cache layer: KIVI-style packed keys (per channel) and values (per token).

See :func:`kvedit.compress.quantize` for how a state gets these layers. Shapes as
:class:`~kvedit.cache.LayerKV`; packed data as :class:`~kvedit.cache.packed.PackedKV`
documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptCacheError
from .packed import PackedKV, PackedLayerKV, load_packed_kv, packed_kv_tensors
from .registry import register_layer

__all__ = ["QuantizedLayerKV"]


@register_layer
@dataclass(init=False, repr=False, eq=False, frozen=True)
class QuantizedLayerKV(PackedLayerKV):
    """A global layer whose keys and values are stored packed (:class:`PackedKV`).

    ``keys`` and ``values`` are dequantized on every access. Constructed from packed data, or,
    as other ops do (``dataclasses.replace(layer, keys=k)``), from dense ``keys``/``values``
    and the packed data they replace: changed tensors are quantized the way the packed data
    was, unchanged ones (exactly its dequantization) keep it. The exact tail is the packed
    data's full-precision residual. Frozen, as every layer (:class:`~kvedit.cache.LayerKV`).
    """

    kind: ClassVar[str] = "quantized"
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
        self._init_fields(
            packed_keys=packed_keys if keys is None else packed_keys.requantized(keys),
            packed_values=packed_values if values is None else packed_values.requantized(values),
            token_index=token_index,
            positions=positions,
            bias=bias,
            window=None,
        )

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

    @property
    def n_packed(self) -> int:
        """Entries held as codes (the exact residual follows them)."""
        return self.packed_keys.n_quant

    @property
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-precision residuals ``[batch, kv_heads, n - n_packed, head_dim]``."""
        return self.packed_keys.residual, self.packed_values.residual

    def with_tail(
        self,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None,
        tail_keys: torch.Tensor,
        tail_values: torch.Tensor,
    ) -> QuantizedLayerKV:
        """The same codes, followed by ``tail_keys`` / ``tail_values`` (see
        :meth:`PackedLayerKV.with_tail`)."""
        return QuantizedLayerKV(
            token_index=token_index,
            positions=positions,
            bias=bias,
            packed_keys=self.packed_keys.with_residual(tail_keys),
            packed_values=self.packed_values.with_residual(tail_values),
        )

    def dense_kv(self, new_keys=None, new_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values dequantized (``[batch, kv_heads, n (+ k), head_dim]``),
        ``new_keys`` / ``new_values`` appended when given."""
        return self.packed_keys.dequantize(new_keys), self.packed_values.dequantize(new_values)

    def to_tensors(self, cast=None) -> tuple[dict[str, torch.Tensor], dict]:
        """Packed: codes, scales and zero points as they are, the exact residual (cast)."""
        out = packed_kv_tensors(self.packed_keys, self.packed_values, cast)
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
            groups = (int(params["key_group"]), int(params["value_group"]))
            keys, values = load_packed_kv(tensors, bits, groups, device, dtype)
            bias = tensors.get("bias")
            return cls(
                token_index=tensors["token_index"],
                positions=tensors["positions"],
                bias=None if bias is None else bias.to(device),
                window=window,
                packed_keys=keys,
                packed_values=values,
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

    def map(self, fn) -> QuantizedLayerKV:
        return QuantizedLayerKV(
            token_index=fn(self.token_index),
            positions=fn(self.positions),
            bias=None if self.bias is None else fn(self.bias),
            packed_keys=self.packed_keys.map(fn),
            packed_values=self.packed_values.map(fn),
        )
