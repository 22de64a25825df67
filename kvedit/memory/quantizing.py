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

from .. import checks
from ..cache.packed import BITS
from ..compress.quantization import quantize
from ..errors import InvalidInputError
from ..states.state import KVState

__all__ = [
    "EXACT_MESSAGES",
    "GROUP",
    "REQUANTIZE_AFTER",
    "Packing",
    "exact_messages_of",
    "check_bits",
    "exact_old_entries",
    "hold_older_quantized",
    "packed_entry_bytes",
]

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


def packed_entry_bytes(layer, bits: int) -> float:
    """Bytes one entry (every KV head) takes on ``layer`` once packed in ``bits`` bits, KIVI
    style as :func:`kvedit.compress.quantize` packs it: the codes, the keys' scale and zero
    per channel shared by a group of :data:`GROUP` entries, the values' per entry and group of
    channels (float16 scales where the layer is float16 or float32)."""
    b, heads, _, d = layer.kv_shape
    dv = layer.value_shape[3]
    scale = 2  # float16 scale and zero (float32 for float64 layers: not counted here)
    codes = (d + dv) * bits / 8
    key_scales = 2 * scale * d / GROUP
    value_scales = 2 * scale * max(dv // min(GROUP, dv), 1)
    return b * heads * (codes + key_scales + value_scales)


EXACT_MESSAGES = 2
"""``Memory(exact_messages=)``'s default: the last messages ``quantize`` holds exact."""


def exact_messages_of(exact_messages: int | None, recent: int | None = None) -> int:
    """``Memory(exact_messages=)``, or ``recent=``, its older name (None: both not given,
    :data:`EXACT_MESSAGES`), checked. Not what no round forgets: that is ``recent_tokens``.

    Raises:
        InvalidInputError: both given, or not a count.
    """
    if exact_messages is not None and recent is not None:
        raise InvalidInputError("give exact_messages= or recent= (its older name), not both")
    if exact_messages is None and recent is None:
        return EXACT_MESSAGES
    name = "recent" if exact_messages is None else "exact_messages"
    return checks.count(name, recent if exact_messages is None else exact_messages)


class Packing:
    """How a memory with ``quantize`` packs its older messages (:func:`hold_older_quantized`):
    ``bits``, each message's first token (``starts``) and the ``recent`` messages held exact.
    :meth:`exact_from` is the first token held exact; :meth:`pack` packs a state as the memory
    keeps it after a forgetting round."""

    def __init__(self, bits: int, starts: Sequence[int], recent: int):
        self.bits, self.starts, self.recent = bits, list(starts), recent

    def exact_from(self, n_tokens: int) -> int:
        if len(self.starts) <= self.recent:
            return 0
        return self.starts[len(self.starts) - self.recent] if self.recent else n_tokens

    def pack(self, state: KVState) -> KVState:
        return hold_older_quantized(state, self.bits, self.starts, self.recent, forgot=True)
