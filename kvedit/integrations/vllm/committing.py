"""How a turn vLLM served becomes the tokens of the next memory, before the fold
(:func:`kvedit.memory.folding.fold_turn`): :func:`appended` takes the K/V vLLM computed
(the prompt after the memory's slots and the answer, less its last sampled token), keys moved from
vLLM's positions to the memory's (RoPE is relative: by ``next_position - slots``), up to where the
conversation re-rendered with the answer differs; :func:`closed` runs the rest of that rendering
(the answer's last token and the template's closing tokens, which vLLM has no K/V for until
the next turn) through the served model, as :meth:`kvedit.Memory.ask` does at its commit. So a
served memory holds after each turn exactly the tokens an in-process memory holds, and forgets at
the same point.

Shapes: a saved turn's K/V are ``[n, kv_heads, head_dim]`` per layer; a memory's layers
``[1, kv_heads, entries, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import rope
from ...errors import KVEditError
from ...memory.rendering import Rendering, common_prefix
from ...provenance import Step
from ...states.capturing import extend_ids
from ...states.state import KVState
from ...states.view import LastInput
from .turns import SavedTurn

__all__ = ["appended", "closed"]


def appended(
    base: KVState, saved: SavedTurn, prompt: Sequence[int], full: Rendering, turn: str
) -> KVState:
    """``base`` (the memory that served turn ``turn``) followed by the K/V vLLM computed for
    the turn (``prompt``: the engine prompt's tokens after the memory's slots), up to where ``full`` (the
    conversation with the answer, rendered) differs from the tokens vLLM ran, keys moved from
    vLLM's positions to the memory's (a ``computed`` step, ``exact=False``).

    Raises:
        KVEditError: vLLM ran other tokens than the prompt's, or ``full`` does not continue
            the memory.
    """
    n_held = len(base)
    if saved.token_ids[: len(prompt)] != list(prompt):
        raise KVEditError(f"turn {turn}: vLLM saved other tokens than the prompt's")
    m = common_prefix([*base.token_ids.tolist(), *saved.token_ids], full.ids)
    if m < n_held:
        raise KVEditError(
            f"turn {turn}: the conversation rendered with the answer does not continue "
            f"the memory's {n_held} tokens (they differ from token {m})"
        )
    keep = m - n_held
    shift = int(base.next_position) - saved.start  # vLLM's positions -> the memory's
    movers = rope.movers(base.model) if shift and keep else None
    index = torch.arange(n_held, n_held + keep)
    positions = torch.arange(base.next_position, base.next_position + keep)
    layers = []
    for i, layer in enumerate(base.layers):
        # vLLM's K/V are read back to the CPU; the memory lives on the served model's device
        k = saved.keys[i][:keep].transpose(0, 1)[None].to(layer.keys.device)
        v = saved.values[i][:keep].transpose(0, 1)[None].to(layer.values.device)
        if movers is not None:
            k = movers[i].move(k, torch.full((keep,), shift, dtype=torch.long))
        layers.append(layer.append(k, v, index, positions))
    return base.replace(
        layers=layers,
        token_ids=torch.tensor(full.ids[:m], dtype=torch.long),
        offsets=full.offsets[:m].to(torch.long),
        text=full.text,
        position_ids=torch.cat([base.position_ids, positions]),
        next_position=int(base.next_position) + keep,
        last_logits=torch.zeros_like(base.last_logits),
        last_input=LastInput(m - 1, int(base.next_position) + keep - 1),
    ).with_step(Step("computed", "vllm", {"tokens": keep}, exact=False))


def closed(state: KVState, full: Rendering) -> KVState:
    """``state`` (a prefix of ``full``) followed by the rest of ``full``, run here through the
    served model at the memory's next positions: the answer's last sampled token and the
    template's closing tokens, which vLLM has no K/V for until the next turn. So a memory
    holds after a turn exactly the tokens :meth:`kvedit.Memory.ask` commits (the whole
    conversation), and forgets at the same point.

    Raises:
        KVEditError: ``state``'s tokens are not a prefix of ``full``'s.
    """
    n = len(state)
    if state.token_ids.tolist() != full.ids[:n]:
        raise KVEditError(
            f"the memory's {n} tokens are not a prefix of the conversation rendered with the "
            "answer: nothing is appended after the wrong tokens"
        )
    if n == len(full.ids):
        return state
    return extend_ids(state, full.ids[n:], full.offsets[n:], full.text)
