"""Decoding from a state: the :class:`Answer` it returns, token-by-token :class:`Decoder`, the
EOS ids greedy decoding stops at, and sampling of one token from logits.

A state is typed :class:`~kvedit.states.view.StateView` here (:mod:`kvedit.states.state`
imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache.adapter import CacheEntries, dynamic_cache
from ..runtime import forward
from .passes import StateBias, appended_layers
from .view import StateView

__all__ = ["Answer", "Decoder", "eos_ids", "sample"]


@dataclass(frozen=True)
class Answer:
    """A decoded continuation: ``text`` (special tokens skipped), the new ``token_ids``, the
    model's ``logprobs`` of each (one float per token, EOS excluded), and whether it
    ``finished`` at EOS (``False``: cut at the length limit)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False

    def confidence(self, n: int | None = None) -> float:
        """Mean log-probability of the first ``n`` tokens (all by default); ``0.0`` when the
        answer is empty."""
        lps = self.logprobs if n is None else self.logprobs[:n]
        return sum(lps) / len(lps) if lps else 0.0


class Decoder:
    """Token-by-token decoding from a state, for loops that choose their own tokens (two
    states in lockstep, say). The state is never mutated.

    ``Decoder(state, continuation)`` runs the continuation over the state; then
    :attr:`next_logits` ``[vocab]`` predicts the next token and :meth:`push` feeds one token
    (one forward pass over the cache, with the state's stored bias).
    """

    @torch.no_grad()
    def __init__(
        self, state: StateView, continuation: str = "", *, max_new_tokens: int = 0
    ) -> None:
        # refused before any work when continuation and max_new_tokens decoded tokens after it
        # would run past the model's positions
        ids = state.encode(continuation, reserve=max_new_tokens)
        if not ids:
            state.check_room(0, max_new_tokens, what="answer")
        # run() checks the state against its model; without a continuation, check here
        self.model, self.tokenizer = state.require_model() if ids else state.checked_model()
        self.device = state.device
        self.eos_ids = eos_ids(self.model, self.tokenizer, None)
        """The token ids that end an answer (the model's and tokenizer's EOS)."""
        layers = state.layers
        self.position = state.next_position
        if ids:
            logits, full_kv = state.run(ids, logits_to_keep=1)
            layers = appended_layers(layers, full_kv, ids, self.position)
            self.position += len(ids)
            self.next_logits = logits[-1]
        else:
            self.next_logits = state.last_logits
        self._cache = dynamic_cache(layers)
        self._plan = StateBias(layers)
        self.pushed: list[int] = []
        """The tokens :meth:`push` has fed, in order."""

    @torch.no_grad()
    def push(self, token: int) -> torch.Tensor:
        """Feed ``token``; returns (and keeps in :attr:`next_logits`) the next prediction."""
        self.next_logits = forward(
            self.model,
            torch.tensor([[int(token)]], device=self.device),
            torch.tensor([[self.position]], device=self.device),
            self._cache,
            plan=self._plan,
        )[0, -1]
        self.position += 1
        self.pushed.append(int(token))
        return self.next_logits

    def entries(self) -> CacheEntries:
        """The cache the decoder holds now: the state's entries (and the continuation's), then
        one per :attr:`pushed` token (:class:`~kvedit.cache.adapter.CacheEntries`, views of
        the decoder's own tensors; :meth:`~kvedit.cache.adapter.CacheEntries.first` cuts it
        back). For keeping the K/V of decoded tokens instead of computing them again."""
        return CacheEntries(self._cache, len(self._cache.layers), len(self.pushed))


def eos_ids(model, tok, override: int | Sequence[int] | None = None) -> set[int]:
    """The token ids greedy decoding stops at: ``override``, else the model's generation
    config's ``eos_token_id``, else the tokenizer's (empty when none is known)."""
    if override is not None:
        return {override} if isinstance(override, int) else set(override)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def sample(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> int:
    """One token id from ``logits [vocab]``: the argmax, or a sample (temperature, top-k, top-p)."""
    if not do_sample:
        return int(torch.argmax(logits))
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None:
        sorted_p, order = probs.sort(descending=True)
        cut = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p[cut] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
