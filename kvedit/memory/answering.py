"""Answering over a memory: decoding with stop strings, and committing the answer's tokens
without computing them twice.

:func:`decode` runs a :class:`~kvedit.states.decoding.Decoder` over the state that holds the
question and the generation prompt, token by token, until EOS, a stop string or
``max_new_tokens``. :func:`commit` then builds the memory's next state from the answer as the
renderer renders it: the decoded tokens' K/V are kept up to the first token where the rendering
differs (a stop string cut, an answer that tokenizes differently as text), and only the rest
(the end-of-turn markup, and any differing tail) is run through the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import is_headwise
from ..errors import InvalidInputError, InvalidTypeError
from ..focusing.choice import DEFAULT_GUARD
from ..focusing.guard import Guard, check_guard
from ..states.capturing import appended_state, extend_ids
from ..states.decoding import Decoder, Sampling, eos_ids
from ..states.state import KVState
from .records import Turn
from .rendering import Message, Rendering, common_prefix

__all__ = ["Commit", "Decoded", "answer_turns", "commit", "common_prefix", "decode", "guard_of"]


@dataclass(frozen=True)
class Decoded:
    """An answer decoded over a memory: its ``text`` (cut before a stop string, special tokens
    skipped), the generated ``token_ids``, the :class:`Decoder` that made them (its
    ``pushed`` tokens hold K/V), and why it ended
    (``"eos"``, ``"stop"`` or ``"length"``)."""

    text: str
    token_ids: list[int]
    decoder: Decoder
    ended: str


@torch.no_grad()
def decode(
    state: KVState,
    max_new_tokens: int,
    stops: Sequence[str] = (),
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Decoded:
    """Decode from ``state`` (which ends with the generation prompt) until EOS, a stop string
    or ``max_new_tokens``; the answer's text is cut before the first stop string. The sampling
    arguments are checked (:class:`~kvedit.states.decoding.Sampling`) before any work."""
    sampling = Sampling(do_sample, temperature, top_k, top_p, generator)
    sampling.check_device(state.last_logits.device)
    dec = Decoder(state, max_new_tokens=max_new_tokens)
    eos = eos_ids(dec.model, dec.tokenizer)
    tokens: list[int] = []
    ended = "length"
    for step in range(max_new_tokens):
        token = sampling.pick(dec.next_logits)
        if token in eos:
            ended = "eos"
            break
        tokens.append(token)
        text = dec.tokenizer.decode(tokens, skip_special_tokens=True)
        if stops and any(s in text for s in stops):
            ended = "stop"
            break
        if step < max_new_tokens - 1:
            dec.push(token)
    text = dec.tokenizer.decode(tokens, skip_special_tokens=True)
    if ended == "stop":
        text = text[: min(text.find(s) for s in stops if s in text)]
    return Decoded(text, tokens, dec, ended)


@dataclass(frozen=True)
class Commit:
    """The memory's next state after an answer, and how it was built: ``kept`` decoded tokens
    whose K/V were kept, the model run from token ``rerun_from`` to the end, ``recomputed``
    tokens of that run that had been computed once already (while asking or decoding), and
    ``note`` saying why."""

    state: KVState
    kept: int
    rerun_from: int
    recomputed: int
    note: str


def commit(
    memory: KVState, prompt: KVState, decoded: Decoded, full: Rendering, *, focused: bool
) -> Commit:
    """The state of ``full`` (the conversation with the answer, as rendered) built from what
    answering computed.

    Args:
        memory: the memory's state before the question (a prefix of ``full``).
        prompt: ``memory`` followed by the question and the generation prompt, the state the
            answer was decoded from (over the unedited memory unless ``focused``).
        decoded: the answer (:func:`decode`).
        full: the rendering to commit.
        focused: the answer was decoded over a focused view: nothing it computed is kept, the
            question and the answer are run again over the unedited memory.
    """
    ids = full.ids
    n_mem, n_prompt = len(memory), len(prompt)
    pushed = decoded.decoder.pushed
    if focused:
        return _rerun(
            memory,
            full,
            n_prompt - n_mem + min(len(pushed), len(ids) - n_prompt),
            "decoded over a focused view: the question and the answer are run again over "
            "the unedited memory",
        )
    held = prompt.token_ids.tolist() + pushed
    m = common_prefix(held, ids)
    if m == len(ids) and m < len(held):
        m -= 1  # the answer ends inside what was decoded: rerun its last token for its logits
    if m < n_prompt:
        return _rerun(
            memory,
            full,
            n_prompt - n_mem + min(len(pushed), len(ids) - n_prompt),
            "the answer's first tokens merge with the generation prompt's last token when "
            "rendered: the question is run again with them",
        )
    k = m - n_prompt
    base = prompt
    if k:
        last = decoded.decoder.next_logits if m == len(held) else None
        if last is None:  # the logits after token m come from the run of the rest below
            last = torch.zeros_like(prompt.last_logits)
        entries = decoded.decoder.entries().first(k)
        base = appended_state(
            prompt, ids[n_prompt:m], entries, last, full.offsets[n_prompt:m], full.text
        )
    state = extend_ids(base, ids[m:], full.offsets[m:], full.text) if m < len(ids) else base
    again = max(0, min(len(held), len(ids)) - m)
    note = (
        f"{again} decoded tokens render differently (a stop string cut, or text that "
        "tokenizes otherwise): run again as rendered"
        if again
        else ""
    )
    return Commit(state, k, m, again, note)


def _rerun(memory: KVState, full: Rendering, recomputed: int, note: str) -> Commit:
    """Everything after the memory run again over it."""
    n = len(memory)
    return Commit(
        extend_ids(memory, full.ids[n:], full.offsets[n:], full.text), 0, n, recomputed, note
    )


def answer_turns(
    question: Message,
    answer: Message,
    index: int,
    tokens: tuple[int, int, int],
    full: Rendering,
    done: Commit,
) -> list[Turn]:
    """The :class:`~kvedit.memory.records.Turn` of a question (message ``index``) and of its
    answer, committed as ``done`` says. ``tokens``: where the question starts, where it ends
    and where the generation prompt ends; the answer ends with ``full`` (the rendering
    committed). The generation prompt belongs to the answer."""
    n, n_q, n_p = tokens
    end = len(full.ids)
    again = done.rerun_from <= n  # the question was run again with the answer
    return [
        Turn(
            index,
            question.role,
            question.content,
            n,
            n_q,
            "computed",
            n_q - n,
            recomputed=(n_q - n) if again else 0,
            note=done.note if again else "",
        ),
        Turn(
            index + 1,
            answer.role,
            answer.content,
            n_q,
            end,
            "decoded" if done.kept else "computed",
            (end - n_q) if again else (n_p - n_q) + (end - done.rerun_from),
            kept=done.kept,
            recomputed=done.recomputed - (n_q - n if again else 0),
            note=done.note,
        ),
    ]


def guard_of(focus: bool | Guard, state=None) -> Guard | None:
    """The guard ``Memory.ask(focus=...)`` asks for, None for no focus; refused before any
    work over a ``state`` (the memory's) that forgot per KV head, which focus cannot read.

    Raises:
        InvalidInputError: focus asked of a memory whose layers hold other entries per head.
    """
    if focus is False or focus is None:
        return None
    if state is not None and any(map(is_headwise, state.layers)):
        raise InvalidInputError(
            "focus needs the same entries on every KV head, and this memory forgot per KV head "
            "(keep='head', the default of an arrival policy under max_tokens): ask without "
            "focus; a memory that focuses is made with keep='layer' (what it forgot per head "
            "stays so, loaded or not)"
        )
    if focus is True:
        return DEFAULT_GUARD
    if isinstance(focus, bool):
        raise InvalidTypeError(f"focus must be True, False or a guard, not {focus!r}")
    return check_guard(focus)
