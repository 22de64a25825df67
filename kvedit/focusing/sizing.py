"""Strengths in nats: how an additive attention-logit bias relates to shares and to PASTA.

A bias of ``s`` multiplies a key's unnormalised attention weight by ``e**s``. A span holding a
share ``p`` of a query's attention then gets ``p' = p·e^s / (p·e^s + 1 − p)``.
"""

from __future__ import annotations

import math

from ..errors import InvalidInputError

__all__ = ["strength_for_share", "strength_from_pasta_alpha"]


def strength_for_share(current: float, target: float) -> float:
    """The strength (nats) that moves a span's attention share from ``current`` to ``target``."""
    if not (0 < current < 1 and 0 < target < 1):
        raise InvalidInputError("shares must be strictly between 0 and 1")
    return math.log(target * (1 - current) / (current * (1 - target)))


def strength_from_pasta_alpha(alpha: float) -> float:
    """PASTA's scaling coefficient α for non-emphasized tokens, as a strength in nats."""
    if not 0 < alpha <= 1:
        raise InvalidInputError("alpha must be in (0, 1]")
    return -math.log(alpha)
