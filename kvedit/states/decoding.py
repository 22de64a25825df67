"""Decoding from a state: the :class:`Answer` it returns, token-by-token :class:`Decoder`, the
EOS ids greedy decoding stops at, and how one token is chosen from logits (:class:`Sampling`:
greedy, or sampled with a temperature, top-k and top-p, its arguments checked once, before any
work, by every path that decodes).

A state is typed :class:`~kvedit.states.view.StateView` here (:mod:`kvedit.states.state`
imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import checks
from ..cache.adapter import CacheEntries, dynamic_cache
from ..errors import InvalidInputError, InvalidTypeError
from ..runtime import forward
from .passes import StateBias, appended_layers
from .view import StateView

__all__ = [
    "MAX_REPETITION_PENALTY",
    "PENALTY_WINDOW",
    "SAMPLING_KEYWORDS",
    "Answer",
    "Decoder",
    "Sampling",
    "eos_ids",
    "sample",
]

SAMPLING_KEYWORDS = ("do_sample", "temperature", "top_k", "top_p", "generator")
"""The keyword arguments that choose how tokens are picked (:class:`Sampling`'s fields, but
``repetition_penalty``, which only the paths that keep the tokens seen take)."""

MAX_REPETITION_PENALTY = 10.0
"""The largest ``repetition_penalty`` taken (its range: ``(0, 10]``)."""

PENALTY_WINDOW = 64
"""How many tokens before an answer a ``repetition_penalty`` counts as seen (llama.cpp's
``repeat_last_n`` default), beside every token of the answer itself."""


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


@dataclass(frozen=True)
class Sampling:
    """How each token is chosen: the argmax (``do_sample=False``, the default), or a sample of
    the logits divided by ``temperature``, cut to the ``top_k`` best tokens and to the smallest
    set whose probability reaches ``top_p``, drawn with ``generator``.

    Every argument is checked when built, so a decoding path builds one before any work:
    ``do_sample`` a real bool (``"False"`` is not false); ``temperature`` a finite number,
    above 0 when sampling (0 or less would not sample: give ``do_sample=False`` for greedy),
    at least 0 otherwise; ``top_k`` None or an int of at least 1; ``top_p`` None or a number
    in ``(0, 1]``; ``generator`` None or a ``torch.Generator``; ``repetition_penalty`` a
    number in ``(0, 10]`` (1.0, the default: off). The values are held in canonical form (a
    ``float`` temperature, an ``int`` top-k).

    ``repetition_penalty`` (Hugging Face's and llama.cpp's meaning, greedy or sampled): before
    the temperature, the logit of each token already seen is divided by it where positive and
    multiplied by it where negative (above 1: a repeat is less likely). Seen: the tokens the
    caller passes to :meth:`pick` (:func:`kvedit.memory.answering.decode`: every token of the
    answer so far and the last :data:`PENALTY_WINDOW` tokens before it), the EOS ids never
    (penalizing the end of an answer would only lengthen it).

    Raises:
        InvalidTypeError: an argument of the wrong type.
        InvalidInputError: an argument out of its range.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        do_sample = checks.flag("do_sample", self.do_sample)
        temperature = checks.real("temperature", self.temperature)
        if do_sample and temperature <= 0:
            raise InvalidInputError(
                f"temperature must be above 0 to sample, not {temperature!r} "
                "(for greedy decoding give do_sample=False)"
            )
        if temperature < 0:
            raise InvalidInputError(f"temperature must be at least 0, not {temperature!r}")
        top_k = self.top_k
        if top_k is not None:
            top_k = checks.count("top_k", top_k, minimum=1)
        top_p = self.top_p
        if top_p is not None:
            top_p = checks.real("top_p", top_p)
            if not 0 < top_p <= 1:
                raise InvalidInputError(f"top_p must be in (0, 1], not {top_p!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise InvalidTypeError(
                f"generator must be a torch.Generator or None, not {checks.describe(self.generator)}"
            )
        penalty = checks.real("repetition_penalty", self.repetition_penalty)
        if not 0 < penalty <= MAX_REPETITION_PENALTY:
            raise InvalidInputError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1.0: off; "
                f"above 1 makes a repeat less likely), not {penalty!r}"
            )
        for name, value in (
            ("repetition_penalty", penalty),
            ("do_sample", do_sample),
            ("temperature", temperature),
            ("top_k", top_k),
            ("top_p", top_p),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, keywords: Mapping[str, object]) -> Sampling:
        """The sampling that the :data:`SAMPLING_KEYWORDS` among ``keywords`` ask for (the
        others are ignored)."""
        return cls(**{k: keywords[k] for k in SAMPLING_KEYWORDS if k in keywords})

    def check_device(self, device: torch.device | str) -> None:
        """Refuse a ``generator`` on another device than the logits it will sample
        (``device``), before any work."""
        if self.generator is None or not self.do_sample:
            return
        if torch.device(self.generator.device).type != torch.device(device).type:
            raise InvalidInputError(
                f"generator is on {self.generator.device}, the model's logits on {device}: "
                "give a torch.Generator of the model's device"
            )

    def pick(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> int:
        """One token id from ``logits [vocab]``; ``seen``: the token ids a
        ``repetition_penalty`` other than 1 penalizes (required then: a penalty is never
        silently left out)."""
        logits = self.penalized(logits, seen)
        if not self.do_sample:
            return int(torch.argmax(logits))
        logits = logits.float() / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p is not None:
            sorted_p, order = probs.sort(descending=True)
            cut = sorted_p.cumsum(-1) - sorted_p > self.top_p
            sorted_p[cut] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def penalized(self, logits: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """``logits`` with the ``seen`` tokens' logits divided by ``repetition_penalty`` where
        positive, multiplied where negative (``logits`` itself when the penalty is 1)."""
        if self.repetition_penalty == 1.0:
            return logits
        if seen is None:
            raise InvalidInputError(
                "repetition_penalty needs the tokens seen: this decoding path does not keep "
                "them (give repetition_penalty=1.0)"
            )
        ids = seen.to(device=logits.device, dtype=torch.long).unique()
        if not len(ids):
            return logits
        chosen = logits[ids]
        penalty = self.repetition_penalty
        out = logits.clone()
        out[ids] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
        return out


def sample(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> int:
    """One token id from ``logits [vocab]``: :meth:`Sampling.pick` (the arguments checked)."""
    return Sampling(do_sample, temperature, top_k, top_p, generator).pick(logits)
