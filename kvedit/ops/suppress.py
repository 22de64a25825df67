"""``suppress``: lower attention to chosen spans (a negative stored bias)."""

from __future__ import annotations

from collections.abc import Sequence

from .. import checks
from ..spans import Spans
from ..state import KVState
from .emphasize import emphasize


def suppress(
    state: KVState,
    spans: Spans,
    strength: float = 2.0,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state whose ``spans`` keys get ``-strength`` nats; see :func:`emphasize`."""
    return emphasize(state, spans, -checks.strength("strength", strength), layers)
