"""One turn folded into a memory: :func:`fold_turn`, the rule :class:`kvedit.Memory` and
``kvedit serve``'s memories (:mod:`kvedit.integrations.vllm.conversations`) both follow, so that
the two cannot drift apart.

A turn's tokens are appended to the memory's state by whoever computed them (``Memory`` runs the
model; the server appends what vLLM computed, and the answer's closing tokens it ran itself).
The fold then, in order:

1. scores the arrivals (:func:`~kvedit.memory.held.arrived`: an arrival policy scores the new
   entries once, beside the scores the memory kept);
2. takes the protected ranges (:func:`~kvedit.memory.protection.protected_ranges`: every system
   message's turn and its text wherever the template writes it);
3. fits the budget (:meth:`~kvedit.memory.budget.Budget.fit`: a forgetting round when the
   memory is over it, the new entries ranked with the old);
4. with ``settle``, gives the kept entries compact positions where the budget repositions
   ``"always"`` (:func:`~kvedit.memory.repositioning.compact_positions`): a server does it at
   the commit, since it cannot know how long the next request is; a ``Memory`` does the same
   before its next message or question (:func:`~kvedit.memory.repositioning.with_room`), so the
   entries a turn keeps are the same either way.

:func:`system_turns` gives the server the system messages' turns as a ``Memory`` that added the
messages one by one holds them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidInputError
from ..states.state import KVState
from .budget import Budget
from .forgetting import Round
from .held import Scores, arrived
from .protection import protected_ranges
from .records import Turn
from .rendering import Message, Rendering
from .repositioning import compact_positions

__all__ = ["Folded", "fold_turn", "system_turns"]


@dataclass(frozen=True)
class Folded:
    """A turn folded into a memory (:func:`fold_turn`).

    Attributes:
        state: the memory's state, fitted to the budget.
        scores: the arrival policy's scores of its entries (None for other policies).
        rounds: the forgetting round the fit made (empty: none).
        forgot: entries forgotten, summed over the layers (0 without a round).
        scoring_seconds: seconds the arrival policy spent scoring the new entries.
        reposition_seconds: seconds spent giving the entries compact positions (``settle``).
    """

    state: KVState
    scores: Scores | None
    rounds: tuple[Round, ...]
    forgot: int = 0
    scoring_seconds: float = 0.0
    reposition_seconds: float = 0.0


def fold_turn(
    budget: Budget | None,
    state: KVState,
    scores: Scores | None,
    start: int,
    turns: Sequence[Turn],
    messages: Sequence[Message],
    rendering: Rendering,
    *,
    packing=None,
    settle: bool = False,
) -> Folded:
    """Fold the tokens ``[start, len(state))`` just appended to a memory's ``state`` into it.

    Args:
        budget: the memory's budget (None: nothing is scored or forgotten).
        scores: the arrival scores the memory kept before the new tokens (None: none).
        start: where the new tokens start (the memory's length before them).
        turns: the memory's turns with the new ones, in order (at least the system messages'
            and the last turn's: the round is recorded at the last turn's index).
        messages: every message of the memory, the new ones included.
        rendering: their rendering (the state's tokens are a prefix of its ids).
        packing: how the memory packs its older messages
            (:class:`~kvedit.memory.quantizing.Packing`, with ``quantize``; None: not packed).
        settle: give the kept entries compact positions now when the budget repositions
            ``"always"`` (module docstring).

    Raises:
        InvalidInputError: the protected part alone exceeds the budget, ``start`` is not in
            the state, or no turns are given under a budget.
        StateAlteredError: the state's layers do not hold the kept scores' slots.
    """
    if not 0 <= start <= len(state):
        raise InvalidInputError(f"start={start} is not in the {len(state)}-token state")
    if budget is not None and not turns:
        raise InvalidInputError("a fold under a budget needs the turns (at least the last one)")
    t0 = time.perf_counter()
    scores = arrived(budget, state, scores, start, len(state))
    scoring = time.perf_counter() - t0 if scores is not None else 0.0
    if budget is None:
        return Folded(state, None, (), 0, scoring)
    ranges = protected_ranges(turns, messages, rendering)
    before = _entries(state)
    state, scores, done = budget.fit(state, scores, ranges, turns[-1].index, packing)
    forgot = before - _entries(state)
    moving = 0.0
    if settle and budget.reposition == "always":
        t0 = time.perf_counter()
        state = compact_positions(state, reason="always")
        moving = time.perf_counter() - t0
    rounds = () if done is None else (done,)
    return Folded(state, scores, rounds, forgot, scoring, moving)


def system_turns(renderer, messages: Sequence[Message]) -> tuple[Turn, ...]:
    """The turns of the system messages among ``messages`` as a memory that added them one at
    a time holds them: message ``i``'s turn runs from the end of the rendering of the messages
    before it (0 for the first) to the end of the rendering through it."""
    out = []
    for i, m in enumerate(messages):
        if m.role != "system":
            continue
        start = len(renderer.render(list(messages[:i])).ids) if i else 0
        end = len(renderer.render(list(messages[: i + 1])).ids)
        out.append(Turn(i, m.role, m.content, start, end, "computed", end - start))
    return tuple(out)


def _entries(state: KVState) -> int:
    """Entries ``state`` holds, summed over its layers."""
    return sum(len(layer) for layer in state.layers)
