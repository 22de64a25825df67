"""KVzip: entries scored by how much the model reads them while repeating their own chunk.

Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
(arXiv:2505.23416), scored as the authors' code and kvpress's ``KVzipPress`` score it: the text
is cut into chunks (:attr:`KVzip.chunk` tokens); each chunk is re-read, teacher-forced, after a
repeat prompt, on top of the whole cache; an entry's score is the largest attention its chunk's
re-read queries give it (over the query heads sharing its KV head too), **normalized over the
sinks, the chunk and the re-read itself** rather than over the whole cache. The normalization
is what sets it apart from :class:`~kvedit.compress.scorers.reconstruct.Reconstruct` (which
normalizes over everything the cache holds): a chunk's scores do not shrink as the cache grows,
so scores made at different times and cache sizes compare.

That makes the scorer usable when entries arrive (:meth:`KVzip.score_tokens`): a
:class:`kvedit.Memory` scores each message's entries once, when the message is added, with the
message as its chunk, and keeps the scores; nothing is re-read later. :meth:`KVzip.score` scores
a whole state at once (chunks of :attr:`~KVzip.chunk` tokens), as kvpress does after a prefill.

Cost: a chunk's re-read is a forward pass of the prompt and the chunk over the cache, about the
cost of computing the chunk itself. Sliding-window layers (Gemma-3) run with their window and
are never scored for compression (:func:`kvedit.compress.select` keeps them whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ... import checks
from ...cache import LayerKV, is_headwise, refuse_headwise
from ...errors import InvalidInputError
from ...states.observer import Observer
from ...states.passes import appended_layers, run_model
from ...states.state import KVState
from ..observe import to_kv_heads
from .base import Scorer, register_scorer
from .reconstruct import DEFAULT_PROMPT

__all__ = ["KVzip", "SINKS"]

SINKS = 4
"""Leading tokens in every chunk's normalization (attention sinks, kvpress's ``n_sink``)."""

QUERIES = 256
"""Re-read tokens run at once: memory ``[batch, heads, QUERIES, k]`` per layer; the scores do
not depend on it (each part runs on top of the parts before it)."""


class _ChunkMax(Observer):
    """Per layer ``[batch, heads, m]``: the largest attention the observed queries give the
    entries ``entries[layer]`` (indices into the first ``own[layer]`` keys), normalized over
    those entries, the layer's sink entries and every key after the first ``own[layer]`` (the
    prompt's and the re-read's own)."""

    output_from_probs = True

    def __init__(self, layers, entries, sinks, own, skip: int):
        super().__init__(layers)
        self.entries, self.sinks, self.own, self.skip = entries, sinks, own, skip

    def observe(self, layer_idx: int, probs: torch.Tensor) -> None:
        if layer_idx not in self.entries or probs.shape[2] <= self.skip:
            return
        p = probs[:, :, self.skip :].float()  # [batch, heads, q, k]
        own = self.own[layer_idx]
        part = p[..., self.entries[layer_idx]]
        sinks = self.sinks[layer_idx]
        if sinks.ndim == 2:  # a headwise layer: [kv_heads, own], each head's sinks its own
            mask = sinks.to(p.device).repeat_interleave(p.shape[1] // sinks.shape[0], dim=0)
            sunk = (p[..., : sinks.shape[1]] * mask[None, :, None, :]).sum(-1)
        else:
            sunk = p[..., sinks].sum(-1)
        total = part.sum(-1) + sunk + p[..., own:].sum(-1)
        self.probs[layer_idx] = (part / total.clamp_min(1e-30)[..., None]).amax(dim=2)


@register_scorer("kvzip")
@dataclass(frozen=True)
class KVzip(Scorer):
    """KVzip's chunk-local reconstruction scores (module docstring).

    Attributes:
        chunk: tokens per chunk when :meth:`score` scores a whole state (kvpress's 2048).
        prompt: the repeat instruction; None: :data:`~kvedit.compress.scorers.reconstruct.DEFAULT_PROMPT`.
    """

    chunk: int = 2048
    prompt: str | None = None

    arrival: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    reads_model: ClassVar[bool] = True

    def __post_init__(self) -> None:
        checks.count("chunk", self.chunk, minimum=1)
        if self.prompt is not None:
            checks.text("prompt", self.prompt)

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{layer: [batch, kv_heads, n]}`` float32 for a whole state, chunk by chunk."""
        refuse_headwise(state.layers, "kvzip's scoring of a whole state")
        out = {i: torch.zeros(*state.layers[i].kv_shape[:2], len(state.layers[i])) for i in layers}
        chunk = min(self.chunk, self._room(state))  # a re-read must fit the positions left
        for start in range(0, len(state), chunk):
            end = min(len(state), start + chunk)
            for i, s in self.score_tokens(state, start, end, layers).items():
                held = state.layers[i].entries_for(torch.arange(start, end)).cpu()
                out[i][..., held] = s.cpu()
        return out

    def _room(self, state: KVState) -> int:
        """The most tokens one chunk's re-read may hold after the prompt (the positions left
        after the state), at least 1."""
        model, _ = state.require_model()
        prompt = state.encode(DEFAULT_PROMPT if self.prompt is None else self.prompt, "prompt")
        limit = checks.positions_limit(model, state.max_positions)
        if limit is None:
            return self.chunk
        room = limit - state.next_position - len(prompt)
        if room < 1:
            raise InvalidInputError(
                f"kvzip: no position is left after the state's {state.next_position} for a "
                f"re-read (the model attends to {limit})"
            )
        return room

    def score_tokens(
        self, state: KVState, start: int, end: int, layers: Sequence[int]
    ) -> dict[int, torch.Tensor]:
        """``{layer: [batch, kv_heads, m]}``: the scores of layer ``i``'s entries of tokens
        ``[start, end)`` (``m`` of them, in the layer's order), with those tokens as the chunk.

        Raises:
            InvalidInputError: an empty or out-of-range token range, or no room after the
                state's positions for the prompt and the re-read.
        """
        if not 0 <= start < end <= len(state):
            raise InvalidInputError(
                f"tokens [{start}, {end}) are not in the {len(state)}-token state"
            )
        model, _ = state.require_model()
        prompt = state.encode(DEFAULT_PROMPT if self.prompt is None else self.prompt, "prompt")
        ids = state.token_ids[start:end].tolist()
        state.check_room(len(prompt) + len(ids), what="KVzip re-read")
        tokens = torch.arange(start, end)
        entries = {i: state.layers[i].entries_for(tokens) for i in layers}
        sinks = {i: _sinks(state.layers[i], min(SINKS, start)) for i in layers}
        best = _reread_max(state, model, prompt, ids, entries, sinks)
        return {i: to_kv_heads(best[i], state.layers[i].kv_shape[1], "max") for i in layers}


def _sinks(layer: LayerKV, count: int) -> torch.Tensor:
    """The layer's entries of the first ``count`` tokens: their slot indices, or a headwise
    layer's ``[kv_heads, n]`` bool mask (its heads hold them in different slots, which its
    shared ``token_index`` does not name)."""
    if is_headwise(layer):
        return (layer.head_index >= 0) & (layer.head_index < count)
    return ((layer.token_index >= 0) & (layer.token_index < count)).nonzero().flatten()


@torch.no_grad()
def _reread_max(state: KVState, model, prompt: list[int], ids: list[int], entries, sinks):
    """Per layer of ``entries`` ``[batch, heads, m]``: the largest chunk-normalized attention
    the re-read of ``ids`` (after ``prompt``, on top of the state) gives ``entries[layer]``."""
    work = list(state.layers)
    position = state.next_position
    own = [len(layer) for layer in work]
    device = work[0].device
    run = prompt + ids
    best: dict[int, torch.Tensor] = {}
    done = 0
    while done < len(run):
        part = run[done : done + QUERIES]
        skip = max(0, len(prompt) - done)  # the prompt's own queries are not scored
        observer = _ChunkMax(work, entries, sinks, own, skip)
        positions = torch.arange(position, position + len(part))
        _, kv = run_model(
            model,
            work,
            torch.tensor([part], device=device),
            positions[None].to(device),
            logits_to_keep=1,
            plan=observer,
        )
        if skip < len(part):
            for i, got in observer.probs.items():
                best[i] = got if i not in best else torch.maximum(best[i], got)
        work = appended_layers(work, kv, part, position)
        position += len(part)
        done += len(part)
    return best
