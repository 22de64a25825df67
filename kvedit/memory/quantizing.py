"""Older messages held in low bits: ``Memory(quantize=4)``.

The entries of every message before the last ``recent`` ones are held KIVI-style in ``bits``
bits (:func:`kvedit.compress.quantize`: keys per channel in groups of :data:`GROUP` entries,
values per entry); the last ``recent`` messages and the last input stay exact (under a budget,
what each global layer still holds of them). It is a second axis beside forgetting: it shrinks
the bytes each entry takes (``max_bytes`` counts the bytes held, packed ones included), never the
entries ``max_tokens`` counts.

When it runs (:func:`hold_older_quantized`): once the exact entries older than the recent
messages reach :data:`REQUANTIZE_AFTER`, the older part is packed again. Packing again from the
codes' own values gives the same codes where a key group keeps its entries (each group's least
and greatest values are codes 0 and ``2**bits - 1``), so the older part is not rounded twice by
new messages. A forgetting round drops entries from the packed part (its layers are then dense,
holding the dequantized values) and the same call packs them again (all but the last partial
key group, at most ``GROUP - 1`` entries): the key groups are formed
anew from the kept entries, a second rounding of those keys. So the memory holds its older part
packed after every call; only within a call does it hold it dense.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cache.packed import BITS
from ..compress.quantization import quantize
from ..errors import InvalidInputError
from ..states.state import KVState

__all__ = ["GROUP", "REQUANTIZE_AFTER", "check_bits", "exact_old_entries", "hold_older_quantized"]

GROUP = 32
"""Entries per key scale group (KIVI's group size; it divides the bundled models' head
dimensions, 64 and 256)."""

REQUANTIZE_AFTER = 2 * GROUP
"""Exact entries older than the recent messages that make the older part be packed again: each
packing re-reads the whole older part, so it runs once per two key groups, not per message."""


def check_bits(bits: int | None) -> int | None:
    """``quantize=``: None (off) or one of :data:`kvedit.cache.packed.BITS`."""
    if bits is None:
        return None
    if isinstance(bits, bool) or bits not in BITS:
        raise InvalidInputError(
            f"quantize must be one of {list(BITS)} (bits) or None, not {bits!r}"
        )
    return bits


def exact_old_entries(state: KVState, exact_from: int) -> int:
    """Entries of a global layer of ``state`` for tokens before ``exact_from`` that are held
    exact (not packed)."""
    if not state.global_layers:
        return 0
    layer = state.layers[state.global_layers[0]]
    old = int((layer.token_index < exact_from).sum())
    packed = layer.n_packed if layer.packed else 0
    return max(old - packed, 0)


def hold_older_quantized(
    state: KVState, bits: int, starts: Sequence[int], recent: int, forgot: bool = False
) -> KVState:
    """``state`` with the global layers' entries of the messages before the last ``recent``
    (``starts``: each message's first token) packed in ``bits`` bits (whole key groups), when
    :data:`REQUANTIZE_AFTER` or more of them are exact or, with ``forgot`` (a forgetting round
    made them dense), when any are; else ``state`` itself. The last ``recent`` messages stay
    exact."""
    if len(starts) <= recent:
        return state
    exact_from = starts[len(starts) - recent] if recent else len(state)
    old = exact_old_entries(state, exact_from)
    if old < (1 if forgot else REQUANTIZE_AFTER):
        return state
    # a forgetting round may have dropped some of the recent messages' entries on some layers:
    # each layer's exact tail is what it holds of them
    tails = [max(int((layer.token_index >= exact_from).sum()), 1) for layer in state.layers]
    return quantize(state, bits, residual=tails, group=GROUP)
