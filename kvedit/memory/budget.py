"""A :class:`kvedit.Memory`'s budget: how much it may hold and when a round forgets
(:class:`Budget`, made from ``Memory``'s keywords by :func:`budget_from`).

The budget is what the memory holds after each message and each kept answer, counted as
kvpress counts a compressed context: ``max_tokens`` entries per global-attention layer on
average (:func:`~kvedit.memory.forgetting.global_entries`), or ``max_bytes``, the bytes the cache
allocates (:attr:`KVState.nbytes`, every layer, padding included). A question and its answer
come on top while it is answered. A message (or a kept answer) that takes the memory past its
budget is followed by a round (:meth:`Budget.fit`, :func:`kvedit.memory.forgetting.forget`) that
ranks the new entries with the older ones and forgets down to the budget; a policy that scores
at each round forgets down to :data:`LOW_WATER` of it. No round drops the first tokens, the
system message, the last ``recent_tokens`` tokens or the ``protect`` spans
(:meth:`Budget.protected_tokens`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import checks
from ..compress.scorers import Scorer, make_scorer
from ..errors import InvalidInputError, SpanNotFoundError
from ..spans import as_span_list
from ..states.state import KVState
from .budget_checks import checked_layer_floor, checked_reposition
from .forgetting import (
    DEFAULT_POLICY,
    FALLBACK_POLICY,
    SINK_TOKENS,
    Round,
    check_policy,
    default_policy,
    entry_bytes,
    entry_costs,
    forget,
    global_entries,
    protected_slots,
)
from .keeping import KEEPS, checked_keep, keep_of
from .repositioning import position_cap

__all__ = [
    "BYTE_STEP",
    "BYTE_TRIES",
    "LOW_WATER",
    "RECENT_TOKENS",
    "KEEPS",
    "Budget",
    "added_bytes",
    "budget_from",
    "keep_of",
    "never_forgotten",
    "span_from_json",
    "span_to_json",
]

LOW_WATER = 0.8
"""What a policy that scores at each round (re-reading what the memory holds) forgets down to,
as a fraction of the room the budget leaves: such a round costs in proportion to the memory, so
it runs once every several messages rather than at each."""

RECENT_TOKENS = 16
"""The last tokens no round drops: what the next message's first tokens read (a template's
turn markup, the end of the last message), counted in tokens so that at a tenth of a long
conversation they remain a small part of the budget."""


def never_forgotten(n_tokens: int, ranges: Sequence[tuple[int, int]], recent_tokens: int) -> int:
    """How many of ``n_tokens`` tokens no round drops (without ``protect`` spans): the first
    :data:`SINK_TOKENS`, the ``ranges`` (system messages), the last ``recent_tokens`` and the
    last one."""
    return int(_kept_always(n_tokens, ranges, recent_tokens).sum())


def _kept_always(n: int, ranges: Sequence[tuple[int, int]], recent_tokens: int) -> torch.Tensor:
    """``BoolTensor[n]``: the tokens no round drops whatever the ``protect`` spans
    (:func:`never_forgotten`)."""
    keep = torch.zeros(n, dtype=torch.bool)
    keep[: min(SINK_TOKENS, n)] = True
    keep[max(n - recent_tokens, 0) :] = True
    if n:
        keep[-1] = True
    for start, end in ranges:
        keep[max(start, 0) : end] = True
    return keep


def span_to_json(span) -> dict:
    """A ``protect`` span as a memory file holds it: ``{"text"}`` (a substring),
    ``{"pattern", "flags"}`` (a compiled regex) or ``{"chars"}`` (a ``(start, end)`` range)."""
    if isinstance(span, str):
        return {"text": span}
    if isinstance(span, re.Pattern):
        return {"pattern": span.pattern, "flags": span.flags}
    start, end = span
    return {"chars": [int(start), int(end)]}


def span_from_json(item: Mapping):
    """The span :func:`span_to_json` wrote (not checked; a ``re.error`` for a bad pattern)."""
    if "text" in item:
        return item["text"]
    if "pattern" in item:
        return re.compile(item["pattern"], item["flags"])
    start, end = item["chars"]
    return (start, end)


@dataclass(frozen=True)
class Budget:
    """How much a memory may hold and how it forgets (``Memory(max_tokens=, max_bytes=,
    forget=, recent_tokens=, protect=, keep=)``; module docstring).

    Attributes:
        max_tokens: the most entries a global layer holds on average when a question comes
            (None with ``max_bytes``).
        max_bytes: the most bytes the cache allocates (None with ``max_tokens``).
        policy: a registered scorer's name.
        recent_tokens: the last tokens no round drops.
        protect: spans of the memory's text never forgotten (as :func:`kvedit.compress.select`
            takes them); a span not (yet) in the text protects nothing.
        keep: ``"head"``, ``"layer"`` or ``"token"`` (:data:`KEEPS`; never ``"auto"``).
        reposition: when the kept entries get compact positions
            (:data:`~kvedit.memory.repositioning.REPOSITIONS`).
        layer_floor: the fraction of a round's room shared equally among the global layers
            before the one ranking across them (:func:`~kvedit.memory.forgetting.forget`).
    """

    max_tokens: int | None
    max_bytes: int | None = None
    policy: str = DEFAULT_POLICY
    recent_tokens: int = RECENT_TOKENS
    protect: tuple = ()
    keep: str = "layer"
    reposition: str = "at_limit"
    layer_floor: float = 0.0

    @property
    def per_head(self) -> bool:
        """Each KV head keeps its own entries (``keep="head"``)."""
        return self.keep == "head"

    @property
    def per_layer(self) -> bool:
        """Each global layer keeps its own entries (all but ``keep="token"``)."""
        return self.keep != "token"

    @property
    def scorer(self) -> Scorer:
        return make_scorer(self.policy)

    def to_json(self) -> dict:
        """The budget as a memory file's ``budget`` holds it: the ``Memory`` keywords that give
        it again (``max_tokens``, ``max_bytes``, ``forget``, ``recent_tokens``, ``protect``: each
        span as :func:`span_to_json` writes it; ``keep`` as the file format has held it since
        before ``keep=``, so that every kvedit reading memory files reads it: ``per_head``, and
        ``per_layer`` when False)."""
        out = {
            "max_tokens": self.max_tokens,
            "max_bytes": self.max_bytes,
            "forget": self.policy,
            "recent_tokens": self.recent_tokens,
            "per_head": self.per_head,
            "protect": [span_to_json(span) for span in self.protect],
        }
        if not self.per_layer:  # written only when off: files that keep none read as per layer
            out["per_layer"] = False
        if self.reposition != "at_limit":  # written only when set: files without it read so
            out["reposition"] = self.reposition
        if self.layer_floor:  # likewise: 0 (one ranking alone) is what a file without it reads
            out["layer_floor"] = self.layer_floor
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> Budget:
        """The budget :meth:`to_json` wrote (``keep`` read from ``per_head`` and ``per_layer``,
        or from a ``keep`` field; not checked: a file's budget is checked first,
        :mod:`kvedit.memory.attached`, and a memory makes its budget from the checked keywords
        with :func:`budget_from`; a bad ``layer_floor`` is refused by name)."""
        keep = data.get("keep") or keep_of(None, data.get("per_head"), data.get("per_layer"))
        return cls(
            data["max_tokens"],
            data["max_bytes"],
            data["forget"],
            data["recent_tokens"],
            tuple(span_from_json(item) for item in data["protect"]),
            "layer" if keep == "auto" else keep,
            data.get("reposition") or "at_limit",
            checked_layer_floor(data.get("layer_floor", 0.0), "budget.layer_floor"),
        )

    def describe(self) -> str:
        """The budget in words (``"760 entries per layer"``, ``"2.0 MiB"``)."""
        if self.max_bytes is not None:
            return f"{self.max_bytes / 2**20:.2f} MiB"
        return f"{self.max_tokens} entries per layer"

    def protected_tokens(self, state: KVState, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``BoolTensor[len(state)]``: the tokens no round drops (module docstring); ``ranges``:
        token ranges ``[start, end)`` of the system messages."""
        keep = _kept_always(len(state), ranges, self.recent_tokens)
        for span in self.protect:
            try:
                keep[state.token_indices(span)] = True
            except SpanNotFoundError:
                continue
        return keep

    def over(self, state: KVState) -> bool:
        """Whether ``state`` holds more than the budget allows."""
        if self.max_bytes is not None:
            return state.nbytes > self.max_bytes
        return global_entries(state) > self.max_tokens

    def fit(
        self,
        state: KVState,
        scores: dict[int, torch.Tensor] | None,
        ranges: Sequence[tuple[int, int]],
        at_message: int,
        packing=None,
    ) -> tuple[KVState, dict[int, torch.Tensor] | None, Round | None]:
        """``(state, scores, round)`` of a state a message (or a kept answer) was just added
        to: unchanged within the budget, else forgotten to fit it. The new entries are ranked
        with the older ones: a round never drops a better entry to admit a worse new one.
        ``scores``: the arrival scores the memory keeps (None for other policies); ``ranges``:
        the system messages' tokens; ``packing``: how the memory packs its older messages
        (:class:`~kvedit.memory.quantizing.Packing`, with ``quantize``): a byte budget then
        prices them packed and measures the state packed, which it returns.

        Raises:
            InvalidInputError: the protected part alone exceeds the budget (before the memory
                keeps anything).
        """
        if not self.over(state):
            return state, scores, None
        protected = self.protected_tokens(state, ranges)
        if self.max_bytes is not None:
            return self._forget_bytes(state, scores, protected, at_message, packing)
        needed = _protected_entries(state, protected)
        if needed > self.max_tokens:
            raise InvalidInputError(
                f"the budget is {self.max_tokens} entries; the protected part (the first "
                f"{SINK_TOKENS} tokens, system message, the last {self.recent_tokens} tokens, "
                f"protect= spans) holds {needed}: raise max_tokens/max_bytes, or protect less"
            )
        room = max(self._low_water() * self.max_tokens, needed)
        return self._round(state, scores, protected, room, at_message)

    def _round(self, state, scores, protected, room, at_message, **bytes_kw):
        """:func:`forget` ``state`` to ``room`` with this budget's policy, heads and layers
        (``bytes_kw``: ``in_bytes``, ``packed`` for a byte budget)."""
        return forget(
            state,
            scores,
            protected,
            self.policy,
            room,
            at_message,
            per_head=self.per_head,
            per_layer=self.per_layer,
            cap=position_cap(state, self.reposition),
            floor=self.layer_floor,
            **bytes_kw,
        )

    def _low_water(self) -> float:
        """The fraction of the room a round forgets down to: 1 for an arrival policy (a round
        only ranks kept scores), :data:`LOW_WATER` for one that scores at each round."""
        return 1.0 if self.scorer.arrival else LOW_WATER

    def _forget_bytes(self, state, scores, protected, at_message, packing=None):
        """:func:`forget` to ``max_bytes`` (less the layers no round forgets), priced and
        measured as the memory holds it (``packing``: the older messages packed); again with
        another room while what the round left does not fit, or fits far under (the prices are
        estimates: a headwise layer's padding, packed scales), at most :data:`BYTE_TRIES` times;
        the fullest state that fits is kept."""
        fixed = _fixed_bytes(state)
        if fixed >= self.max_bytes:
            raise InvalidInputError(
                f"the budget is {self.describe()}; the sliding-window layers alone hold "
                f"{fixed / 2**20:.2f} MiB (their windows, which no round forgets): raise max_bytes"
            )
        packed = None if packing is None else (packing.bits, packing.exact_from(len(state)))
        room = (self.max_bytes - fixed) * self._low_water()
        best = None
        for _ in range(BYTE_TRIES):
            if room < 0:
                break
            try:
                out = self._round(
                    state, scores, protected, room, at_message, in_bytes=True, packed=packed
                )
            except InvalidInputError:  # the protected entries alone cost more than the room
                break
            priced = min(room, _priced(out[0], packed))  # what the round spent at its prices
            if packing is not None:
                out = (packing.pack(out[0]), *out[1:])
            used = out[0].nbytes - fixed
            target = (self.max_bytes - fixed) * self._low_water()
            fits = out[0].nbytes <= self.max_bytes
            if fits and (best is None or out[0].nbytes > best[0].nbytes):
                best = out
            if fits and used >= (1 - BYTE_STEP) * target:
                break
            # the prices are estimates (padding, a partial key group left exact, scales): the
            # next room is the target at the ratio of the prices to what was really held
            nxt = target * priced / max(used, 1.0)
            room = nxt if fits else min(nxt, room * (1 - BYTE_STEP))
        if best is not None:
            return best
        windows = (
            f"the sliding-window layers hold {fixed / 2**20:.2f} MiB of it (their windows, "
            f"{_window_bytes(state) / 2**20:.2f} MiB once full) and "
            if fixed
            else ""
        )
        raise InvalidInputError(
            f"the budget is {self.describe()}; {windows}the protected part (the first "
            f"{SINK_TOKENS} tokens, system message, the last {self.recent_tokens} tokens, "
            "protect= spans) takes the rest and more: raise max_bytes, or protect less"
        )


BYTE_TRIES = 8
"""Rounds a byte budget runs at most to fit (each fits the padding the last one left)."""

BYTE_STEP = 0.02
"""The least a retried round lowers its room by, as a fraction of it: a few bytes over may buy
back no entry (an entry costs more), and a head's padding follows the longest head."""


def added_bytes(state: KVState, n_new: int) -> int:
    """Bytes ``n_new`` more tokens add to ``state``'s cache: an entry on every layer (a
    sliding-window layer only until its window is full), in each layer's dtype."""
    total = 0
    for layer in state.layers:
        more = n_new if layer.window is None else max(min(n_new, layer.window - len(layer)), 0)
        total += more * entry_bytes(layer)
    return total


def _priced(state: KVState, packed) -> float:
    """What the entries the global layers of ``state`` hold cost at a round's prices."""
    total = 0.0
    for i in state.counted_layers:
        cost = entry_costs(state.layers[i], True, packed)
        heads = state.layers[i].kv_shape[1]
        count = state.layers[i].head_entries() / heads
        total += float(cost.sum()) if isinstance(cost, torch.Tensor) else cost * count
    return total


def _fixed_bytes(state: KVState) -> int:
    """Bytes of the layers no round forgets (sliding-window ones)."""
    counted = set(state.counted_layers)
    return sum(layer.nbytes for i, layer in enumerate(state.layers) if i not in counted)


def _window_bytes(state: KVState) -> int:
    """Bytes the sliding-window layers of ``state`` hold once their windows are full."""
    return sum(
        layer.window * entry_bytes(layer) for layer in state.layers if layer.window is not None
    )


def _protected_entries(state: KVState, protected: torch.Tensor) -> int:
    """The protected tokens' entries a global layer holds at most (per KV head, on average)."""
    most = 0.0
    for i in state.counted_layers:
        slots = protected_slots(state.layers[i], protected)
        most = max(most, float(slots.sum()) / max(slots.shape[0], 1))
    return -int(-most // 1)


def budget_from(
    state: KVState,
    *,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    forget: str | None = None,
    recent_tokens: int = RECENT_TOKENS,
    protect=None,
    keep: str | None = None,
    quantize: int | None = None,
    per_head: bool | None = None,
    per_layer: bool | None = None,
    reposition: str | None = None,
    layer_floor: float = 0.0,
) -> Budget | None:
    """The :class:`Budget` of ``Memory``'s keywords (None without ``max_tokens`` or
    ``max_bytes``), checked before any work; ``state`` is the memory's (empty) state.
    ``keep`` (:data:`KEEPS`; ``per_head=``/``per_layer=``, the older keywords, map to it,
    :func:`keep_of`) ``"auto"``/None: ``"head"`` where the policy scores arrivals, the model's
    global layers have more than one KV head, ``quantize`` is off (it holds the same entries on
    every head) and the budget counts entries (a byte budget would pay for the padding of heads
    holding unequal counts), else ``"layer"``; ``forget`` None: :func:`default_policy`;
    ``layer_floor`` (:func:`~kvedit.memory.budget_checks.checked_layer_floor`), above 0 only
    with a budget.

    Raises:
        InvalidInputError: a bad keyword, or ``forget=``/``protect=`` without a budget
            (nothing is forgotten without one).
    """
    budgeted = max_tokens is not None or max_bytes is not None
    reposition = checked_reposition(reposition, quantize)
    floor = checked_layer_floor(layer_floor) or None
    for name, value in (
        ("forget", forget),
        ("protect", protect),
        ("reposition", reposition),
        ("layer_floor", floor),
    ):
        if value is not None and not budgeted:
            raise InvalidInputError(
                f"{name}= without a budget: give max_tokens= or max_bytes= (nothing is "
                "forgotten without one)"
            )
    if not budgeted:
        forget = FALLBACK_POLICY  # no budget: nothing is forgotten, the arguments still checked
    elif forget is None:
        forget = default_policy(state)
    scorer = check_policy(forget, state)
    recent_tokens = checks.count("recent_tokens", recent_tokens)
    if budgeted and max_tokens is not None and max_bytes is not None:
        raise InvalidInputError("give max_tokens or max_bytes, not both")
    keep = checked_keep(keep_of(keep, per_head, per_layer), state, forget, scorer, quantize)
    if keep == "auto":  # a byte budget would pay for the padding of unequal heads
        several = any(state.layers[i].kv_shape[1] > 1 for i in state.global_layers)
        by_head = scorer.arrival and several and quantize is None and max_bytes is None
        keep = "head" if by_head else "layer"
    protect = () if protect is None else tuple(as_span_list(protect))
    how = (forget, recent_tokens, protect, keep, reposition or "at_limit", floor or 0.0)
    if max_bytes is not None:
        return Budget(None, checks.count("max_bytes", max_bytes, minimum=1), *how)
    if max_tokens is None:
        return None
    return Budget(checks.count("max_tokens", max_tokens, minimum=1), None, *how)
