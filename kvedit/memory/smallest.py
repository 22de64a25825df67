"""The smallest budget a :class:`kvedit.Memory` can hold, from the model's layers alone (no
forward pass over any message): :func:`smallest_budget`, and the refusal of a budget under it
(:func:`check_holds`) where budgets enter (``Memory(max_tokens=, max_bytes=)``, ``Memory.load``,
``kvedit chat --max-tokens/--max-bytes``), before the model runs.

What no round forgets sets the floor (:mod:`kvedit.memory.budget`): the sliding-window layers'
entries (their windows, once full), and on each global layer the protected part: the first
:data:`~kvedit.memory.forgetting.SINK_TOKENS` tokens, the system message, the last
``recent_tokens`` tokens and the last token. A budget holds that plus at least one more token,
or every message past the windows is refused. ``protect=`` spans are not counted (a span not in
the text protects nothing): a budget above the floor may still be refused when they fill it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import LayerKV
from ..errors import InvalidInputError
from ..states.state import KVState
from .budget import RECENT_TOKENS, Budget
from .forgetting import SINK_TOKENS, entry_bytes
from .protection import protected_ranges, system_text_ranges
from .quantizing import packed_entry_bytes
from .rendering import Message, Renderer

__all__ = [
    "NEVER_HOLDS",
    "SmallestBudget",
    "check_holds",
    "file_head_tokens",
    "smallest_budget",
    "system_head",
]

NEVER_HOLDS = "can never hold"
"""What :func:`check_holds`'s refusal says after the budget (``"max_bytes=100 can never
hold: ..."``), for a caller that names the budget its own way (``kvedit chat``'s options)."""

_SLOT_BYTES = 2 * torch.empty(0, dtype=torch.long).element_size()
"""A headwise layer's slot of one entry on one KV head: its token and its position."""


@dataclass(frozen=True)
class SmallestBudget:
    """The smallest budgets a memory holds (:func:`smallest_budget`).

    Attributes:
        max_tokens: the smallest ``max_tokens`` (entries per global layer on average).
        max_bytes: the smallest ``max_bytes``: :attr:`window_bytes` plus :attr:`protected_bytes`.
        window_bytes: what the sliding-window layers hold once their windows are full (no
            round forgets them; 0 without such layers).
        protected_tokens: the tokens no round drops on a global layer (the first tokens, the
            system message, the last ``recent_tokens``, the last one).
        protected_bytes: those tokens and one more on the global layers, in bytes.
    """

    max_tokens: int
    max_bytes: int
    window_bytes: int
    protected_tokens: int
    protected_bytes: int

    def why(self, recent_tokens: int) -> str:
        """What fills the smallest budget, in words."""
        windows = (
            f"the sliding-window layers alone hold {_size(self.window_bytes)} once their "
            "windows are full (no round forgets them), and "
            if self.window_bytes
            else ""
        )
        return (
            f"{windows}the protected part (the first {SINK_TOKENS} tokens, the system message, "
            f"the last {recent_tokens} tokens, the last token) is {self.protected_tokens} "
            f"tokens on each global layer ({_size(self.protected_bytes)} with one more token)"
        )


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 2**10 else f"{n / 2**10:.1f} KiB ({n:,} bytes)"


def smallest_budget(
    source,
    *,
    system_tokens: int = 0,
    recent_tokens: int = RECENT_TOKENS,
    quantize: int | None = None,
    per_head: bool = False,
) -> SmallestBudget:
    """The smallest ``max_tokens`` and ``max_bytes`` a memory of ``source``'s model holds
    (module docstring), from its layers alone: no forward pass.

    Args:
        source: the model (a ``PreTrainedModel`` kvedit runs; its layers' windows, KV heads,
            head sizes and dtype), or a memory's :class:`~kvedit.KVState` (its layers).
        system_tokens: the tokens at the start of the transcript no round drops besides the
            first :data:`~kvedit.memory.forgetting.SINK_TOKENS`: the system message's, counted
            from the transcript's first token (so that the sinks are among them), as
            :func:`system_head` counts them; 0: no system message.
        recent_tokens: the last tokens no round drops (``Memory(recent_tokens=)``).
        quantize: ``Memory(quantize=)``: the protected tokens but the last priced packed (the
            cheapest they can be held).
        per_head: each KV head keeps its own entries (their slots priced too).
    """
    layers = source.layers if isinstance(source, KVState) else _model_layers(source)
    counted = _counted(layers)
    head = max(SINK_TOKENS, int(system_tokens))
    tail = max(int(recent_tokens), 1)  # the last token is kept whatever recent_tokens
    window_bytes, tokens, protected_bytes = 0, [], 0.0
    for i, layer in enumerate(layers):
        full = entry_bytes(layer) + (_SLOT_BYTES * layer.kv_shape[1] if per_head else 0)
        if i not in counted:
            window_bytes += layer.window * full
            continue
        if layer.window is None:
            first, last = head, tail + 1
        else:  # every layer slides: the first tokens leave its window, the last stay
            first, last = 0, min(tail + 1, layer.window)
        tokens.append(first + last)
        cheap = full if quantize is None else min(full, packed_entry_bytes(layer, quantize))
        protected_bytes += (first + last - 1) * cheap + full  # the last token held exact
    protected_bytes = int(-(-protected_bytes // 1))
    max_tokens = -(-sum(tokens) // len(tokens))
    return SmallestBudget(
        max_tokens, window_bytes + protected_bytes, window_bytes, max_tokens - 1, protected_bytes
    )


def _counted(layers: Sequence[LayerKV]) -> set[int]:
    """The layers a budget counts (:attr:`KVState.counted_layers`)."""
    global_layers = {i for i, layer in enumerate(layers) if layer.window is None}
    return global_layers or set(range(len(layers)))


def _model_layers(model) -> list[LayerKV]:
    """Empty layers shaped as ``model``'s cache (from the gate's probe of the model)."""
    from ..runtime import spec

    param = next(model.parameters())
    none = torch.empty(0, dtype=torch.long)
    return [
        LayerKV(
            torch.empty(1, s.kv_heads, 0, s.key_dim, dtype=param.dtype),
            torch.empty(1, s.kv_heads, 0, s.value_dim, dtype=param.dtype),
            none,
            none,
            window=s.window,
        )
        for s in spec(model).layers
    ]


def _head(ranges: Sequence[tuple[int, int]], n: int) -> int:
    """The tokens of ``[0, SINK_TOKENS)`` and ``ranges`` (of a transcript of ``n`` tokens)."""
    keep = torch.zeros(max(n, SINK_TOKENS), dtype=torch.bool)
    keep[:SINK_TOKENS] = True
    for start, end in ranges:
        keep[max(start, 0) : end] = True
    return int(keep.sum())


def system_head(renderer: Renderer, system: str | None) -> int:
    """The ``system_tokens`` of :func:`smallest_budget` for a memory whose first message is
    ``system`` (None: the sinks alone): its turn, and its text wherever the template writes it
    once a message follows (a rendering only: no forward pass)."""
    if system is None:
        return SINK_TOKENS
    first = Message("system", system)
    alone = renderer.render([first])
    after = renderer.render([first, Message("user", "?")])
    ranges = [(0, len(alone.ids)), *system_text_ranges([first], after)]
    return _head(ranges, len(after.ids))


def file_head_tokens(attachment) -> int:
    """The ``system_tokens`` of a memory file's messages (its checked attachment)."""
    ranges = protected_ranges(attachment.turns, attachment.messages, attachment.rendering)
    return _head(ranges, len(attachment.rendering.ids))


def check_holds(
    budget: Budget | None,
    state: KVState,
    *,
    system_tokens: int = 0,
    quantize: int | None = None,
) -> None:
    """Refuse ``budget`` (None: nothing to check) when it is under what a memory of ``state``
    (its empty or loaded state) can hold (:func:`smallest_budget`), before any work.

    Raises:
        InvalidInputError: naming the budget, the smallest that holds and why.
    """
    if budget is None:
        return
    least = smallest_budget(
        state,
        system_tokens=system_tokens,
        recent_tokens=budget.recent_tokens,
        quantize=quantize,
        per_head=budget.per_head,
    )
    if budget.max_bytes is not None and budget.max_bytes < least.max_bytes:
        given, smallest = f"max_bytes={budget.max_bytes:,}", f"{least.max_bytes:,} bytes"
        advice = "raise max_bytes"
    elif budget.max_tokens is not None and budget.max_tokens < least.max_tokens:
        given, smallest = f"max_tokens={budget.max_tokens}", f"{least.max_tokens} entries"
        advice = "raise max_tokens"
    else:
        return
    raise InvalidInputError(
        f"{given} {NEVER_HOLDS}: the smallest budget that holds is {smallest}: "
        f"{least.why(budget.recent_tokens)}; {advice}, or lower recent_tokens="
    )
