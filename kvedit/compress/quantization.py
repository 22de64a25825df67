"""``quantize``: KIVI-style low-bit keys and values, the most recent tokens kept exact.

Following KIVI (Liu et al., 2024), keys are quantized *per channel* (a scale and zero point per
channel for each group of ``group`` consecutive tokens: key outliers live in fixed channels) and
values *per token* (a scale and zero point per token for each group of ``group`` channels, or
the whole head when it is smaller).
Quantization is asymmetric min-max to ``bits`` bits (2, 4 or 8), codes packed ``8 // bits`` to a
byte, scales and zero points in float16 (float32 if the tensor exceeds float16's range). The
last ``residual`` to ``residual + group - 1`` entries of each layer stay in full precision, so
the quantized part is whole key groups.

The result is a state whose global layers are :class:`~kvedit.cache.QuantizedLayerKV`
(:mod:`kvedit.cache.quantized`; packed data as :class:`~kvedit.cache.packed.PackedKV`): they
hold the packed codes, and ``layer.keys`` / ``layer.values`` dequantize on access, so
everything that uses a state (``generate``, ``extend``, the other ops) works unchanged and
``state.nbytes`` counts the packed bytes. Continuing from a quantized state keeps the packed
part and appends new entries to the full-precision residual (which is not re-quantized as it
grows; quantize again to compress it). Saving a quantized state writes the packed data (its file
is its packed size). Sliding-window layers (Gemma-3) are left in full precision: they hold at
most ``window`` entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cache import QuantizedLayerKV, refuse_headwise
from ..cache.packed import BITS, PackedKV
from ..errors import InvalidInputError
from ..provenance import Step
from ..states.passes import last_input_entries, recompute_last
from ..states.state import KVState

__all__ = ["quantize"]


def quantize(
    state: KVState, bits: int = 8, residual: int | Sequence[int] = 32, group: int = 32
) -> KVState:
    """A new state with every global layer's K/V quantized to ``bits`` bits, KIVI-style.

    Args:
        state: the state (not modified); a quantized state is re-quantized from its values.
        bits: 2, 4 or 8.
        residual: the most recent entries (at least this many, and always the last input's,
            which :func:`~kvedit.states.passes.recompute_last` reruns) kept in full precision;
            or one count per layer (a memory whose layers hold its recent messages unequally).
        group: tokens per key scale group; channels per value scale group (capped at the head
            dimension, which it must then divide).

    Returns:
        A state whose ``nbytes`` counts packed codes, scales, zero points and the residual;
        its history records a ``quantize`` step (inexact, unless nothing was quantized).
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise InvalidInputError(f"bits must be one of {BITS}, not {bits!r}")
    residuals = [residual] * len(state.layers) if isinstance(residual, int) else list(residual)
    if len(residuals) != len(state.layers):
        raise InvalidInputError(
            f"residual gives {len(residuals)} counts for {len(state.layers)} layers"
        )
    for name, value, low in (*(("residual", r, 0) for r in residuals), ("group", group, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidInputError(f"{name} must be an int >= {low}, not {value!r}")
    refuse_headwise(state.layers, "quantize")
    new_layers = []
    for layer, residual_i in zip(state.layers, residuals, strict=True):
        n, d = len(layer), layer.keys.shape[-1]
        channels = min(group, d)  # values: one scale per token and group of channels
        if d % channels or (d * bits) % 8:
            raise InvalidInputError(
                f"group {group} must divide the head dimension {d} (or exceed it)"
            )
        # the last input's entries stay exact even with residual=0: recompute_last reruns them
        mine = last_input_entries(state, layer).nonzero().flatten()
        exact_from = min(n - residual_i, int(mine.min())) if mine.numel() else n - residual_i
        n_quant = (max(0, exact_from) // group) * group
        if layer.window is not None or n_quant == 0:
            new_layers.append(layer)
            continue
        keys, values = layer.keys, layer.values
        new_layers.append(
            QuantizedLayerKV(
                token_index=layer.token_index,
                positions=layer.positions,
                bias=layer.bias,
                packed_keys=PackedKV.quantize(keys, bits, group, n_quant, "channel"),
                packed_values=PackedKV.quantize(values, bits, channels, n_quant, "token"),
            )
        )
    step = Step(
        "compression",
        "quantize",
        {"bits": bits, "residual": residual, "group": group},
        exact=all(a is b for a, b in zip(new_layers, state.layers, strict=True)),
    )
    return recompute_last(state.replace(layers=new_layers)).with_step(step)
