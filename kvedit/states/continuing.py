"""Continuing from a state: tokens run on top of its cache (:func:`run_ids`), the model's
logits over a continuation (:func:`continuation_logits`) and its log-probabilities of given
tokens (:func:`token_logprobs`), a decoded answer (:func:`answer`), and the state extended by a
text (:func:`extended`). The state is never mutated.

:class:`~kvedit.states.state.KVState`'s methods (``run``, ``logits``, ``token_logprobs``,
``answer``, ``generate``, ``extend``) are the public entry points and say what each does; they
call these. A state is typed :class:`~kvedit.states.view.StateView` here
(:mod:`kvedit.states.state` imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import checks
from ..cache.adapter import CacheEntries
from .decoding import Answer, Decoder, Sampling, eos_ids
from .passes import appended_layers, run_model
from .view import LastInput, StateView

__all__ = ["answer", "continuation_logits", "extended", "run_ids", "token_logprobs"]


def run_ids(
    state: StateView, ids: Sequence[int], logits_to_keep: int = 0
) -> tuple[torch.Tensor, CacheEntries]:
    """:meth:`kvedit.KVState.run`: ``ids`` run on top of ``state`` (the model attached and
    checked, the positions' room checked first). Returns ``(logits [n|keep, vocab], new K/V per
    layer)``."""
    model, _ = state.checked_model()
    n = len(ids)
    state.check_room(n)
    device = state.device
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    positions = torch.arange(state.next_position, state.next_position + n, device=device)[None]
    logits, full_kv = run_model(model, state.layers, input_ids, positions, logits_to_keep)
    return logits[0], full_kv


def continuation_logits(state: StateView, continuation: str) -> torch.Tensor:
    """:meth:`kvedit.KVState.logits`: ``[n_tokens, vocab]``, row 0 the stored last logits,
    row i > 0 the prediction after the continuation's tokens ``< i``."""
    ids = state.encode(continuation)
    if not ids:
        return state.last_logits[None, :0].new_zeros(0, state.last_logits.shape[-1])
    rows = [state.last_logits.float()[None]]
    if len(ids) > 1:
        logits, _ = state.run(ids[:-1])
        rows.append(logits.float())
    return torch.cat(rows, dim=0)


@torch.no_grad()
def token_logprobs(state: StateView, continuation: str, token_ids: Sequence[int]) -> list[float]:
    """:meth:`kvedit.KVState.token_logprobs`: the log-probability of each of ``token_ids``
    after ``state`` and ``continuation``, in one forward pass."""
    prompt = state.encode(continuation)
    vocab = state.last_logits.shape[-1]
    token_ids = [checks.count("token id", t, maximum=vocab - 1) for t in token_ids]
    if not token_ids:
        return []
    ids = prompt + token_ids[:-1]
    rows = [state.last_logits.float()[None]] if not prompt else []
    if ids:
        logits, _ = state.run(ids, logits_to_keep=len(token_ids) - (0 if prompt else 1))
        rows.append(logits.float())
    logp = torch.cat(rows, dim=0)[-len(token_ids) :].log_softmax(-1)
    return logp[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()


@torch.no_grad()
def answer(
    state: StateView,
    continuation: str,
    max_new_tokens: int,
    sampling: Sampling,
    eos_token_id: int | Sequence[int] | None = None,
) -> Answer:
    """:meth:`kvedit.KVState.answer`: up to ``max_new_tokens`` tokens decoded after ``state``
    and ``continuation``, each picked by ``sampling`` (checked by the caller, before any work),
    stopping at EOS."""
    sampling.check_device(state.last_logits.device)
    max_new_tokens = checks.count("max_new_tokens", max_new_tokens)
    dec = Decoder(state, continuation, max_new_tokens=max_new_tokens)
    eos = eos_ids(dec.model, dec.tokenizer, eos_token_id)
    new_tokens: list[int] = []
    logprobs: list[float] = []
    finished = False
    for step in range(max_new_tokens):
        token = sampling.pick(dec.next_logits)
        if token in eos:
            finished = True
            break
        new_tokens.append(token)
        logprobs.append(float(dec.next_logits.float().log_softmax(-1)[token]))
        if step < max_new_tokens - 1:
            dec.push(token)
    text = dec.tokenizer.decode(new_tokens, skip_special_tokens=True)
    return Answer(text, new_tokens, logprobs, finished)


@torch.no_grad()
def extended(state: StateView, text: str) -> StateView:
    """:meth:`kvedit.KVState.extend`: a new state with ``text`` appended (tokenized without
    special tokens), its entries computed on top of ``state``'s cache."""
    ids = state.encode(text, "text")
    if not ids:
        return state.replace(text=state.text + text)
    _, tok = state.require_model()
    logits, full_kv = state.run(ids, logits_to_keep=1)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2) + len(state.text)
    positions = torch.arange(state.next_position, state.next_position + len(ids))
    return state.replace(
        layers=appended_layers(
            state.layers, full_kv, ids, state.next_position, first_index=len(state)
        ),
        token_ids=torch.cat([state.token_ids, torch.tensor(ids, dtype=torch.long)]),
        offsets=torch.cat([state.offsets, offsets]),
        text=state.text + text,
        position_ids=torch.cat([state.position_ids, positions]),
        next_position=state.next_position + len(ids),
        last_logits=logits[-1].float(),
        last_input=LastInput(len(state) + len(ids) - 1, state.next_position + len(ids) - 1),
    )
