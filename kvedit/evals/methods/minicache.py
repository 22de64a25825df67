"""``minicache``: the captured documents' deep layers merged pairwise with
:func:`kvedit.compress.minicache`, optionally quantized too.

``minicache:start=0.5:retain=0.05`` merges adjacent layer pairs from half the depth on,
keeping 5% of each pair's entries exact; ``bits=4`` (or 2, 8) also quantizes the shared
directions and every layer not merged KIVI-style (``bits=0``: no quantization).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedit.compress import minicache
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import check_count, check_fraction, check_int_choice
from kvedit.evals.methods.registry import Method, register_method

__all__ = ["MINICACHE_BITS", "MiniCache", "MiniCacheParams"]

MINICACHE_BITS = (0, 2, 4, 8)
"""0: merging only; 2, 4, 8: merging and KIVI-style quantization at that width."""


@dataclass(frozen=True)
class MiniCacheParams:
    """The parameters of ``minicache``.

    Attributes:
        start: First merged layer, as a fraction of the depth in ``[0, 1]``.
        retain: Fraction of each pair's merged entries kept exact, in ``[0, 1]``.
        bits: 0 (no quantization) or 2, 4, 8 (the cache also quantized).
        t: SLERP interpolation between the two layers' directions, in ``[0, 1]``.
        residual: The most recent tokens left unmerged (and unquantized), >= 1.
    """

    start: float = 0.5
    retain: float = 0.05
    bits: int = 0
    t: float = 0.5
    residual: int = 32

    def __post_init__(self) -> None:
        for name in ("start", "retain", "t"):
            object.__setattr__(self, name, check_fraction(name, getattr(self, name)))
        object.__setattr__(self, "bits", check_int_choice("bits", self.bits, MINICACHE_BITS))
        object.__setattr__(self, "residual", check_count("residual", self.residual, minimum=1))


@register_method("minicache")
class MiniCache(Method):
    """The documents' cache with adjacent deep layers merged (MiniCache)."""

    Params = MiniCacheParams

    def predict(self, ctx: ExampleContext) -> str:
        p = self.params
        state = minicache(
            ctx.state,
            start=float(p.start),
            retain=float(p.retain),
            t=float(p.t),
            residual=p.residual,
            bits=p.bits,
        )
        ctx.compressed(state)
        return state.generate(ctx.continuation, ctx.max_new_tokens)
