"""``quantize``: the captured documents quantized KIVI-style (:func:`kvedit.compress.quantize`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvedit.compress import quantize
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import check_count, check_int_choice
from kvedit.evals.methods.registry import Method, register_method

__all__ = ["QUANTIZE_BITS", "Quantize", "QuantizeParams"]

QUANTIZE_BITS = (2, 4, 8)
"""The bit widths :func:`kvedit.compress.quantize` packs."""


@dataclass(frozen=True)
class QuantizeParams:
    """The parameters of ``quantize``.

    Attributes:
        bits: 2, 4 or 8.
        residual: The most recent tokens kept in full precision (>= 0).
        group: Tokens (keys) and channels (values) per quantization group (>= 1).
    """

    bits: int = 8
    residual: int = 32
    group: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int_choice("bits", self.bits, QUANTIZE_BITS))
        object.__setattr__(self, "residual", check_count("residual", self.residual))
        object.__setattr__(self, "group", check_count("group", self.group, minimum=1))


@register_method("quantize")
class Quantize(Method):
    """The documents' cache quantized KIVI-style."""

    Params = QuantizeParams

    def predict(self, ctx: ExampleContext) -> str:
        p = self.params
        state = quantize(ctx.state, bits=p.bits, residual=p.residual, group=p.group)
        ctx.compressed(state)
        return state.generate(ctx.continuation, ctx.max_new_tokens)
