"""What a :class:`kvedit.Memory` holds at one moment (:class:`Held`, replaced whole by every
change, so an interrupt leaves the memory as it was or as it is after), and the scores an arrival
policy keeps with it (:func:`arrived`).

An arrival policy (:attr:`kvedit.compress.Scorer.arrival`: ``learned``, ``kvzip``) scores each
message's entries once, when they are added, and the memory keeps those scores beside its cache:
``{layer: [kv_heads, n]}`` float32 for each global layer, aligned with the layer's slots (a
headwise layer's padding ``-inf``). New entries are appended after a layer's slots, so their
scores are appended after the layer's; a forgetting round cuts both the same way
(:mod:`kvedit.memory.forgetting`).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import checks
from ..cache import is_headwise
from ..errors import InvalidTypeError, StateAlteredError
from ..states.state import KVState
from .budget import Budget
from .forgetting import Round
from .records import Turn
from .rendering import Message, Rendering

__all__ = [
    "Held",
    "Scores",
    "arrived",
    "bytes_per_token",
    "check_model",
    "scored_from_scratch",
]

Scores = dict[int, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Held:
    """What a memory holds at one moment: its state, messages, rendering, turns, forgetting
    rounds and, for an arrival policy, its entries' scores (None otherwise)."""

    state: KVState
    messages: tuple[Message, ...]
    rendering: Rendering
    turns: tuple[Turn, ...]
    rounds: tuple[Round, ...]
    scores: Scores | None = None


def arrived(
    budget: Budget | None, state: KVState, before: Scores | None, start: int, end: int
) -> Scores | None:
    """The scores of ``state``'s entries: ``before`` (the slots it held, less those a
    sliding-window layer dropped as the new tokens came), then the new tokens ``[start, end)``
    scored now by ``budget``'s arrival policy; None for any other policy.

    Raises:
        StateAlteredError: a layer does not hold ``before``'s slots followed by the new
            tokens' (its entries were changed behind the memory's back).
    """
    if budget is None or not budget.scorer.arrival:
        return None
    layers = list(state.counted_layers)
    new = budget.scorer.score_tokens(state, start, end, layers)
    out = {}
    for i in layers:
        got = new[i][0].float().cpu()
        old = before[i] if before is not None else torch.zeros(got.shape[0], 0)
        if state.layers[i].window is not None:  # a model with no global layer: its window
            kept = len(state.layers[i]) - got.shape[1]  # dropped the oldest slots
            old = old[:, max(old.shape[1] - kept, 0) :]
        if old.shape[1] + got.shape[1] != len(state.layers[i]):
            raise StateAlteredError(
                f"layer {i} holds {len(state.layers[i])} entries, not the {old.shape[1]} scored "
                f"before and the {got.shape[1]} new ones: the memory's cache was altered"
            )
        out[i] = torch.cat([old, got], dim=1)
    return out


def scored_from_scratch(budget: Budget | None, state: KVState) -> Scores | None:
    """Every entry of ``state`` scored by ``budget``'s arrival policy at once (a memory loaded
    from a file that kept no scores of this policy); None for any other policy."""
    if budget is None or not budget.scorer.arrival:
        return None
    layers = list(state.counted_layers)
    got = budget.scorer.score(state, layers)
    out = {}
    for i in layers:
        s = got[i][0].float().cpu()
        layer = state.layers[i]
        padding = layer.head_index.cpu() < 0 if is_headwise(layer) else None
        out[i] = s if padding is None else s.masked_fill(padding, float("-inf"))
    return out


def bytes_per_token(state: KVState) -> float:
    """Bytes one token's entries take on the global layers of ``state``."""
    layers = [state.layers[i] for i in state.global_layers]
    return sum(layer.nbytes / max(len(layer), 1) for layer in layers)


def check_model(model, tokenizer) -> None:
    """Refuse what is not a model and a tokenizer, before any work."""
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        model = (
            f"a transformers model (a torch.nn.Module with a config), not {checks.describe(model)}"
        )
        raise InvalidTypeError(f"model must be {model}")
    if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
        raise InvalidTypeError(f"tokenizer must be the model's, not {checks.describe(tokenizer)}")
