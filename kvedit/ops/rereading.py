"""``reread``: encode chosen passages again after the end of the cache.

The passages' tokens are run through the model once more, at new positions after the cache, with
the whole context in view, and their entries are appended. Later queries then find the important
part near the end, where models attend best: the "read it again" edit that counters
lost-in-the-middle without touching the rest of the cache. The new entries keep the original
token indices, so span lookups find both readings; the last re-read token is the state's last
input (:attr:`kvedit.KVState.last_input`), which every later op recomputes where it sits.
"""

from __future__ import annotations

import torch

from .. import checks
from ..errors import ModelNotAttachedError
from ..provenance import Step, token_ranges
from ..spans import Spans
from ..states.passes import run_model
from ..states.state import KVState, LastInput
from .entries import span_tokens

__all__ = ["reread"]


def reread(state: KVState, spans: Spans, separator: str = "") -> KVState:
    """A new state with the tokens of ``spans`` (in text order) encoded again at the end.

    ``separator`` (e.g. ``"\\n"``) is encoded before the re-read tokens, if given. Positions
    advance by the number of tokens encoded; ``len(state)`` and ``state.text`` are unchanged.
    The last re-read token becomes the state's last input (``last_logits`` follow it, and an
    op after this one recomputes it, at its new position); the history records a ``reread``
    step (the tokens and the separator).

    Raises:
        InvalidTypeError: ``separator`` is not a str.
        InvalidInputError: the re-read would reach past the model's positions (checked before
            the model runs).
    """
    separator = checks.text("separator", separator)
    tokens = span_tokens(state, spans)
    if state.tokenizer is None or state.model is None:
        raise ModelNotAttachedError(
            "reread needs the state's model; load it with load_state(path, model, tok)"
        )
    sep_ids = state.tokenizer(separator, add_special_tokens=False)["input_ids"] if separator else []
    ids = list(sep_ids) + state.token_ids[tokens].tolist()
    index = torch.cat([torch.full((len(sep_ids),), -1, dtype=torch.long), tokens])
    n = len(ids)
    state.check_room(n, what="re-read")  # positions advance past the cache
    device = state.device
    positions = torch.arange(state.next_position, state.next_position + n)
    logits, full_kv = run_model(
        state.model,
        state.layers,
        torch.tensor([ids], device=device),
        positions[None].to(device),
        logits_to_keep=1,
    )
    layers = [
        layer.extended(k, v, index, positions)
        for layer, (k, v) in zip(state.layers, full_kv, strict=True)
    ]
    return state.replace(
        layers=layers,
        next_position=state.next_position + n,
        last_logits=logits[0, -1].float(),
        last_input=LastInput(int(tokens[-1]), state.next_position + n - 1),
    ).with_step(Step("reread", "reread", {"tokens": token_ranges(tokens), "separator": separator}))
