"""Positions that never run out: a memory's kept entries given compact positions
(:func:`compact_positions`), so that a memory under a budget goes on past the model's
positions.

A memory's positions grow with every token it has read, forgotten or not: after forgetting,
its entries sit at scattered positions (the first tokens, the system message, what the policy
kept, the recent tail) and the next token's position is one past everything ever read. When
that position would pass the model's positions, :func:`compact_positions` closes the gaps:
each layer's entries (each KV head's own, in a layer that keeps them per head) are given
consecutive positions in their order, right-aligned so that every layer's newest entry sits at
the same position and the next token right after it; each layer's keys are re-rotated by its
own RoPE (:func:`kvedit.rope.movers`: Gemma-3's sliding and global bases each their own). This
is StreamingLLM's rule ("positions within the cache"), per layer and head: the order of the
entries and the distances within the recent tail every layer holds (the last tokens, a sliding
window) are kept exactly, the distances across a forgotten stretch shrink. It changes
what the model computes, so the state's history records a step ``exact=False`` with the
positions before and after; the memory file holds the moved positions as it holds any.

A memory with no budget never forgets, so its positions have no gaps to close: it still stops
at the model's positions with the room check's error. A layer held packed (``quantize=``) is
refused: its keys would be unpacked and packed again.

Shapes: positions ``[n]`` long; a headwise layer's ``[kv_heads, n]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import checks
from ..errors import InvalidInputError, ModelNotAttachedError
from ..provenance import Step
from ..rope import movers
from ..states.room import check_room
from ..states.state import KVState

__all__ = [
    "POSITION_SHARE",
    "REPOSITIONS",
    "position_cap",
    "check_room_after",
    "compact_end",
    "compact_positions",
    "fits",
    "is_compact",
    "with_room",
]

POSITION_SHARE = 0.75
"""The most entries one layer (one KV head) of a memory that repositions keeps, as a share of
the model's positions: compact positions then leave at least a quarter of them to read before
the next compaction (one ranking over the layers can give a layer nearly everything read)."""

REPOSITIONS = ("at_limit", "always", "never")
"""When a memory under a budget gives its entries compact positions: ``at_limit`` (the
default) when the next message or answer would pass the model's positions, ``always`` before
every message and question (the positions never hold a gap), ``never`` (the memory stops at
the model's positions, as one with no budget does)."""


def position_cap(state: KVState, reposition: str) -> int | None:
    """The most entries a forgetting round lets one layer (one KV head) of ``state`` keep:
    :data:`POSITION_SHARE` of the model's positions where positions are made compact (None:
    ``"never"``, or a model without a limit)."""
    limit = checks.positions_limit(state.model, state.max_positions)
    if reposition == "never" or limit is None:
        return None
    return int(POSITION_SHARE * limit)


def compact_end(state: KVState) -> int:
    """The next position compact positions give ``state``: the most entries one layer (one KV
    head of a headwise layer) holds."""
    return max((layer.longest_head() for layer in state.layers), default=0)


def _unmoved(keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return keys


def is_compact(state: KVState) -> bool:
    """Whether every layer's (every KV head's) entries already sit at consecutive positions
    ending right before the next position, which is :func:`compact_end`."""
    end = compact_end(state)
    if state.next_position != end:
        return False
    for layer in state.layers:
        moved = layer.repositioned(end, _unmoved)
        if not torch.equal(moved.held_entries()[1], layer.held_entries()[1]):
            return False
    return True


def compact_positions(state: KVState, reason: str = "at_limit") -> KVState:
    """``state`` with each layer's (each KV head's) entries at consecutive positions, in order,
    the newest at ``m - 1`` where ``m`` (:func:`compact_end`) is the most entries one holds;
    keys re-rotated by each layer's RoPE; ``position_ids`` of the text's tokens the smallest
    new position a layer gives them (a forgotten token the next kept one's), the last input
    moved with it and the next position ``m``. ``state`` itself is unchanged; a compact state
    is returned as it is.

    Right-aligned per layer and head, not over the union of what the layers hold: each layer
    (each head) keeps its own entries under a budget, so together they cover nearly every
    position read; aligned at their newest entry, the tail every layer holds (the recent
    tokens, a sliding window) keeps one position on every layer.

    Raises:
        ModelNotAttachedError: the state has no model (its RoPE moves the keys).
        InvalidInputError: a layer is held packed (``quantize=``), before any work.
        UnsupportedModelError: a layer whose keys cannot be moved (:func:`kvedit.rope.movers`).
    """
    for i, layer in enumerate(state.layers):
        if layer.packed:
            raise InvalidInputError(
                f"layer {i} is held {layer.kind} (a memory with quantize=): its keys cannot "
                "be given new positions without unpacking and packing them again, so this "
                "memory stops at the model's positions; make it without quantize= to go on"
            )
    if is_compact(state):
        return state
    if state.model is None:
        raise ModelNotAttachedError(
            "giving a memory's entries compact positions moves their keys by the model's "
            "RoPE: attach the model (Memory.load(path, model, tokenizer))"
        )
    end = compact_end(state)
    layer_movers = movers(state.model)
    layers = [layer.repositioned(end, layer_movers[i].move) for i, layer in enumerate(state.layers)]
    position_ids = _token_positions(layers, len(state), end)
    last = state.last_input
    if last is not None:
        last = type(last)(last.token_index, int(position_ids[last.token_index]))
    params = {"reason": reason, "next_position": [int(state.next_position), end]}
    out = state.replace(
        layers=layers, position_ids=position_ids, next_position=end, last_input=last
    )
    return out.with_step(Step("reposition", "compact_positions", params, exact=False))


def _token_positions(layers, n_tokens: int, end: int) -> torch.Tensor:
    """``[n_tokens]``: each token's smallest position on a layer that holds it; a token no
    layer holds gets the next held token's (non-decreasing where the positions are)."""
    out = torch.full((n_tokens,), end, dtype=torch.long)
    for layer in layers:
        index, positions = layer.held_entries()
        index, positions = index.reshape(-1).cpu(), positions.reshape(-1).cpu()
        ok = index >= 0
        out.scatter_reduce_(0, index[ok], positions[ok], reduce="amin")
    out = torch.flip(torch.cummin(torch.flip(out, [0]), 0).values, [0])
    return out.clamp_max(end - 1)


@dataclass(frozen=True)
class _Compacted:
    """What the room check reads of a state (:class:`~kvedit.states.view.StateView`'s model,
    tokenizer, positions), its next position as compact positions would make it."""

    model: object
    tokenizer: object
    max_positions: int | None
    next_position: int


def check_room_after(
    state: KVState,
    reposition: str,
    n_tokens: int,
    reserve: int = 0,
    *,
    what: str,
    n_chars: int | None = None,
) -> None:
    """Refuse (before any work) ``n_tokens`` and ``reserve`` more, or a text of ``n_chars``
    characters, that do not fit in the positions ``state`` would have left once
    :func:`with_room` gave it compact positions where ``reposition`` allows
    (:func:`kvedit.states.room.check_room`'s error: the count, the limit).

    Raises:
        InvalidInputError: no room.
    """
    packed = [i for i, layer in enumerate(state.layers) if layer.packed]
    if reposition != "never" and packed:
        try:
            check_room(state, n_tokens, reserve, what=what, n_chars=n_chars)
        except InvalidInputError as e:
            raise InvalidInputError(
                f"{e}; positions cannot be made compact here: layer {packed[0]} is held packed "
                "(a memory with quantize= and a byte budget), and its keys cannot be moved "
                "without unpacking and packing them again"
            ) from None
        return
    view = state
    if reposition != "never":
        view = _Compacted(state.model, state.tokenizer, state.max_positions, compact_end(state))
    check_room(view, n_tokens, reserve, what=what, n_chars=n_chars)


def with_room(
    state: KVState,
    reposition: str,
    n_tokens: int,
    reserve: int = 0,
    *,
    what: str,
) -> KVState:
    """``state``, given compact positions where ``reposition`` says (:data:`REPOSITIONS`:
    ``"always"``; ``"at_limit"`` when ``n_tokens`` and ``reserve`` more would pass the model's
    positions), checked to have room for them (:meth:`KVState.check_room`) before any work.
    ``state`` itself is unchanged.

    Raises:
        InvalidInputError: no room even with compact positions (the room check's error), or a
            layer held packed at the limit.
    """
    check_room_after(state, reposition, n_tokens, reserve, what=what)
    if reposition == "always" or (reposition == "at_limit" and not fits(state, n_tokens, reserve)):
        state = compact_positions(state, reason=reposition)
    state.check_room(n_tokens, reserve, what=what)
    return state


def fits(state: KVState, n_tokens: int, reserve: int = 0) -> bool:
    """Whether ``n_tokens`` and ``reserve`` more fit in the positions ``state`` has left (as
    they are, without compacting them)."""
    limit = checks.positions_limit(state.model, state.max_positions)
    return limit is None or state.next_position + n_tokens + reserve <= limit
