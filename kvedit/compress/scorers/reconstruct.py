"""Reconstruct: entries scored by the attention the model gives them while repeating the text.

Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
(arXiv:2505.23416; kvpress's ``KVzipPress``). An entry worth keeping is one the model needs to
reproduce its context: after the cache, a repeat instruction (``prompt``) is run, then the
text's own tokens again, teacher-forced; an entry's score is the *largest* attention any of
those reconstruction queries gives it, over the query heads sharing its KV head too. The score
does not depend on any question: one compressed state serves every later query.

Implemented here as a re-read that leaves the state untouched: the prompt and the
reconstruction are run on a working copy of the layers at positions after the state's
(:attr:`~kvedit.KVState.next_position` on), ``chunk`` tokens at a time, each chunk on top
of the cache, the prompt and the chunks before it, so the scores do not depend on ``chunk``
(only memory does: ``[batch, heads, chunk, n + prompt + reconstructed]`` attention per layer,
reduced to its maximum over the chunk's queries at once). When the positions left after the
state cannot hold the prompt and the whole text, the reconstruction is cut into *segments* of
the most tokens that fit, each run afresh on the cache after the prompt (the scores are the
maximum over segments). The reconstructed tokens are the text's tokens but its special ones
(a BOS token, chat markers) whose entries some global layer still holds: a state that forgot
part of its text (:class:`kvedit.Memory` under a budget) reconstructs what it holds. Where its
layers hold different tokens (``forget="reconstruct"`` shares the budget among them), that is
every token any layer holds, which can be most of the transcript.

Every entry is scored by the attention it receives, text tokens or not (a separator, a re-read
copy appended after the text: the reconstruction runs after them and sees them); nothing scores
``+inf`` (:func:`~kvedit.compress.select` protects the last token anyway). Sliding-window layers
(Gemma-3) run with their window as the model does, so their older entries score 0 there;
``select`` keeps those layers whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ... import checks
from ...cache import LayerKV
from ...errors import InvalidInputError
from ...states.observer import Observer
from ...states.passes import appended_layers, run_model
from ...states.state import KVState
from ..observe import to_kv_heads
from .base import Scorer, register_scorer

__all__ = ["DEFAULT_PROMPT", "Reconstruct"]

DEFAULT_PROMPT = "\n\nRepeat the previous context exactly.\n"
"""The repeat instruction run before the reconstruction when ``prompt`` is None (KVzip's, as
plain text: no chat template, so it suits base and instruct models alike)."""


@register_scorer("reconstruct")
@dataclass(frozen=True)
class Reconstruct(Scorer):
    """KVzip's context-reconstruction attention, max over queries and grouped query heads.

    Attributes:
        chunk: Reconstruction tokens run at once (memory ``[batch, heads, chunk, k]`` per
            layer, ``k`` the working cache); the scores do not depend on it.
        prompt: The repeat instruction run after the state, before the text's tokens again;
            None: :data:`DEFAULT_PROMPT`; ``""``: none.
    """

    chunk: int = 256
    prompt: str | None = None

    shared: ClassVar[bool] = True
    whole_words: ClassVar[bool] = True
    reads_model: ClassVar[bool] = True

    def __post_init__(self) -> None:
        checks.count("chunk", self.chunk, minimum=1)
        if self.prompt is not None:
            checks.text("prompt", self.prompt)

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{layer: [batch, kv_heads, n]}`` float32: each entry's largest attention from the
        reconstruction queries (the prompt's own queries excluded)."""
        model, tok = state.require_model()
        prompt = DEFAULT_PROMPT if self.prompt is None else self.prompt
        prompt_ids = state.encode(prompt, "prompt") if prompt else []
        special = set(getattr(tok, "all_special_ids", []) or [])
        token_ids = state.token_ids.tolist()
        ids = [token_ids[t] for t in _held_tokens(state) if token_ids[t] not in special]
        if not ids:
            raise InvalidInputError("reconstruct: the state holds no text token to reconstruct")
        # refused before any work when not even the prompt and one chunk fit after the state
        state.check_room(len(prompt_ids) + min(self.chunk, len(ids)), what="prompt and chunk")
        limit = checks.positions_limit(model, state.max_positions)
        room = len(ids) if limit is None else limit - state.next_position - len(prompt_ids)
        segment = min(len(ids), room)
        best = [None] * len(state.layers)
        for start in range(0, len(ids), segment):
            part = ids[start : start + segment]
            for i, m in enumerate(_segment_max(state, model, prompt_ids, part, self.chunk)):
                best[i] = m if best[i] is None else torch.maximum(best[i], m)
        return {i: to_kv_heads(best[i], state.layers[i].kv_shape[1], "max") for i in layers}


def _held_tokens(state: KVState) -> list[int]:
    """The text tokens whose entries the state's global layers still hold (any of them), in
    order: the context the model reconstructs (a forgotten token is not re-read)."""
    held = torch.cat([state.layers[i].token_index for i in state.counted_layers]).unique()
    return [t for t in held.tolist() if t >= 0]


class _MaxObserver(Observer):
    """Records, per layer, the largest attention ``[batch, heads, m]`` any query gives the
    first ``m = columns[layer]`` keys (the state's entries still in the working cache).

    The pass only scores (its entries feed the later chunks of this scoring, then are dropped),
    so the attention output is taken from the recorded probabilities (``output_from_probs``:
    equal up to rounding) rather than computed a second time."""

    output_from_probs = True

    def __init__(self, layers: Sequence[LayerKV], columns: list[int]):
        super().__init__(layers)
        self.columns = columns

    def observe(self, layer_idx: int, probs: torch.Tensor) -> None:
        cols = self.columns[layer_idx]
        self.probs[layer_idx] = probs[..., :cols].amax(dim=2).float()


@torch.no_grad()
def _segment_max(
    state: KVState, model, prompt_ids: list[int], ids: list[int], chunk: int
) -> list[torch.Tensor]:
    """Per layer ``[batch, heads, n]``: the largest attention each of the state's entries gets
    from ``ids`` run after ``prompt_ids`` on top of the state, ``chunk`` tokens at a time."""
    work = list(state.layers)
    position = state.next_position
    added = 0  # entries appended to the working layers (prompt and reconstructed tokens)
    if prompt_ids:
        work, position, added = _extend(model, work, prompt_ids, position, added)
    best = [
        torch.zeros(layer.kv_shape[0], 1, len(layer), device=layer.device) for layer in state.layers
    ]
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        # a sliding-window layer may have dropped its oldest entries: the state's entries in
        # the working layer are the last ``own`` of the original ones, at its front
        own = [max(0, len(w) - added) for w in work]
        observer = _MaxObserver(work, own)
        positions = torch.arange(position, position + len(part))
        device = work[0].device
        _, entries = run_model(
            model,
            work,
            torch.tensor([part], device=device),
            positions[None].to(device),
            logits_to_keep=1,
            plan=observer,
        )
        for i, layer in enumerate(state.layers):
            got = observer.probs[i]
            if best[i].shape[1] != got.shape[1]:
                best[i] = best[i].expand(-1, got.shape[1], -1).clone()
            tail = best[i][..., len(layer) - own[i] :]
            best[i][..., len(layer) - own[i] :] = torch.maximum(tail, got.to(tail.device))
        work = appended_layers(work, entries, part, position)
        position += len(part)
        added += len(part)
    return best


def _extend(
    model, layers: list[LayerKV], ids: list[int], position: int, added: int
) -> tuple[list[LayerKV], int, int]:
    """``layers`` with ``ids`` run on top at ``position`` on, appended (not text tokens)."""
    device = layers[0].device
    positions = torch.arange(position, position + len(ids))
    _, entries = run_model(
        model, layers, torch.tensor([ids], device=device), positions[None].to(device), 1
    )
    return appended_layers(layers, entries, ids, position), position + len(ids), added + len(ids)
