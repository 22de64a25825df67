"""A continuation already run over a state, kept so the state's greedy answer to it does not run
it again.

Focus scores passages by running the question over the unedited state
(:func:`kvedit.focusing.scoring.question_shares`): the same ids, at the same positions, over the
same cache and bias as the first pass of that state's answer to the question. The attention
observer only reads the probabilities (:mod:`kvedit.states.observer`); the layers' outputs, the
question's K/V and the logits after it are the ones a plain run computes. :class:`Continued`
keeps the question's K/V (a copy of its own entries only: a few tokens per layer) and those
logits; :meth:`Continued.state` is then the state followed by the question, as
:meth:`KVState.extend <kvedit.states.state.KVState.extend>` would make it, without the pass, and
:meth:`Continued.answer` its greedy answer (tokens identical to ``over.answer(text, n)``).

:class:`PrimedState` is the unedited state handed to a guard: the same state, whose greedy
:meth:`~PrimedState.answer` and :meth:`~PrimedState.decoder` of that continuation start from
:class:`Continued` (every other call, and every state derived from it, is the plain state's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache.adapter import CacheEntries
from ..states.decoding import Answer, Decoder, Sampling
from ..states.passes import appended_layers
from ..states.state import KVState, LastInput

__all__ = ["Continued", "PrimedState", "cut_answer"]


class _Appended:
    """What :func:`~kvedit.states.passes.appended_layers` reads of a run's
    :class:`~kvedit.cache.adapter.CacheEntries`, rebuilt from a state's layers and the new
    entries alone: ``[i]`` the stored K/V followed by the new ones, ``new_entries(i)`` the new
    ones."""

    def __init__(self, layers, entries: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self._layers, self._entries = layers, entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer, (k, v) = self._layers[i], self._entries[i]
        return (
            torch.cat([layer.keys, k.to(layer.keys.dtype)], dim=-2),
            torch.cat([layer.values, v.to(layer.values.dtype)], dim=-2),
        )

    def new_entries(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._entries[i]


def cut_answer(answer: Answer, max_new_tokens: int, tokenizer) -> Answer | None:
    """``answer`` (a greedy answer) as a greedy call with ``max_new_tokens`` would return it:
    itself when it is that long or ended at EOS before; its first ``max_new_tokens`` tokens
    when longer; ``None`` when it was cut shorter than ``max_new_tokens`` (the rest is
    unknown)."""
    n = len(answer.token_ids)
    if n == max_new_tokens or (answer.finished and n < max_new_tokens):
        return answer
    if n < max_new_tokens:
        return None
    ids = answer.token_ids[:max_new_tokens]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Answer(text, ids, answer.logprobs[:max_new_tokens], False)


@dataclass(frozen=True)
class Continued:
    """A continuation run once over a state (by focus's scoring pass).

    Attributes:
        over: the state it ran over.
        text: the continuation.
        ids: its token ids.
        entries: per layer, the K/V of its tokens (``[batch, kv_heads, len(ids), dim]`` each;
            copies, so they keep no larger tensor alive).
        logits: ``[vocab]``, the prediction after its last token.
        known: the greedy answer of ``over`` to ``text``, when the caller already has it (a
            caller's word: not checked); :meth:`answer` reads it instead of decoding.
    """

    over: KVState = field(repr=False)
    text: str
    ids: list[int]
    entries: list[tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    logits: torch.Tensor = field(repr=False)
    known: Answer | None = None

    @classmethod
    def from_run(
        cls, over: KVState, text: str, ids: Sequence[int], logits: torch.Tensor, kv: CacheEntries
    ) -> Continued:
        """From a run of ``ids`` (the tokens of ``text``) over ``over``: its ``logits``
        (``[..., vocab]``, the last row is kept) and entries (the new ones are copied)."""
        entries = [tuple(t.clone() for t in kv.new_entries(i)) for i in range(len(kv))]
        return cls(over, text, list(ids), entries, logits.reshape(-1, logits.shape[-1])[-1])

    def matches(self, state: KVState, text: str) -> bool:
        """Whether this is ``text`` run over ``state`` (the same object)."""
        return state is self.over and text == self.text

    def state(self) -> KVState:
        """``over`` followed by :attr:`text`: what ``over.extend(text)`` returns, from the
        kept entries (no forward pass)."""
        over, ids = self.over, self.ids
        _, tok = over.require_model()
        n, start = len(ids), over.next_position
        enc = tok(self.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
        layers = appended_layers(
            over.layers, _Appended(over.layers, self.entries), ids, start, first_index=len(over)
        )
        return over.replace(
            layers=layers,
            token_ids=torch.cat([over.token_ids, torch.tensor(ids, dtype=torch.long)]),
            offsets=torch.cat([over.offsets, offsets + len(over.text)]),
            text=over.text + self.text,
            position_ids=torch.cat([over.position_ids, torch.arange(start, start + n)]),
            next_position=start + n,
            last_logits=self.logits.float(),
            last_input=LastInput(len(over) + n - 1, start + n - 1),
        )

    def answer(self, max_new_tokens: int) -> Answer:
        """The greedy answer of ``over`` to :attr:`text` (up to ``max_new_tokens``): :attr:`known`
        when it holds it, else decoded from :meth:`state`."""
        if self.known is not None:
            _, tok = self.over.require_model()
            cut = cut_answer(self.known, max_new_tokens, tok)
            if cut is not None:
                return cut
        return self.state().answer("", max_new_tokens)


@dataclass(frozen=True)
class PrimedState(KVState):
    """A state whose greedy answer to :attr:`continued`'s text starts from it (see the module
    doc); otherwise the state itself. A state derived from it (:meth:`replace` and every op) is
    a plain :class:`~kvedit.states.state.KVState`."""

    continued: Continued | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, state: KVState, continued: Continued) -> PrimedState:
        """``state`` (its tensors shared) answering ``continued.text`` from ``continued``."""
        state.check_unaltered("priming the state")
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(KVState)}
        return cls(**fields, continued=continued)

    def plain(self) -> KVState:
        """The same state as a plain :class:`~kvedit.states.state.KVState`."""
        self.check_unaltered("a new state built from it")
        return KVState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(KVState)})

    def replace(self, **changes) -> KVState:
        """As :meth:`KVState.replace <kvedit.states.state.KVState.replace>`: a plain state."""
        return self.plain().replace(**changes)

    def _primed(self, continuation: str) -> Continued | None:
        c = self.continued
        return c if c is not None and c.text == continuation else None

    def answer(self, continuation: str = "", max_new_tokens: int = 32, **kw) -> Answer:
        """As :meth:`KVState.answer <kvedit.states.state.KVState.answer>`; a greedy answer
        (no sampling, the model's EOS) to the primed continuation skips its pass."""
        c = self._primed(continuation)
        sampling = Sampling.of(kw)  # checked before any work, on either path
        if c is None or sampling.do_sample or kw.get("eos_token_id") is not None:
            return super().answer(continuation, max_new_tokens, **kw)
        return c.answer(max_new_tokens)

    def decoder(self, continuation: str = "") -> Decoder:
        """As :meth:`KVState.decoder <kvedit.states.state.KVState.decoder>`; the primed
        continuation is not run again."""
        c = self._primed(continuation)
        return super().decoder(continuation) if c is None else c.state().decoder("")
