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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import checks
from ..cache import is_headwise
from ..errors import InvalidInputError, InvalidTypeError
from ..focusing.choice import DEFAULT_GUARD, Focus, focus
from ..focusing.guard import Guard, check_guard
from ..states.capturing import appended_state, extend_ids
from ..states.decoding import PENALTY_WINDOW, Decoder, Sampling, eos_ids
from ..states.state import KVState
from .records import Turn
from .rendering import Message, Rendering, common_prefix

__all__ = [
    "ENDINGS",
    "Answered",
    "Commit",
    "Decoded",
    "OnText",
    "Stripped",
    "TextStream",
    "answer_turns",
    "check_on_text",
    "commit",
    "common_prefix",
    "decode",
    "focused_on",
    "guard_of",
    "stops_of",
]


ENDINGS = ("eos", "stop", "length")
"""Why an answer ended: the model's EOS, a stop string, or ``max_new_tokens`` (cut)."""


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


@dataclass(frozen=True)
class Answered:
    """The last answer :meth:`kvedit.Memory.ask` gave (``Memory.last_answer``):
    its ``text`` (as ``ask`` returned it), the ``n_tokens`` decoded for it (EOS excluded,
    a stop string's tokens included) and why it ``ended``: ``"eos"`` (the model ended it),
    ``"stop"`` (a stop string, cut before it) or ``"length"`` (``max_new_tokens`` reached:
    a cut answer)."""

    text: str
    n_tokens: int
    ended: str

    @property
    def cut(self) -> bool:
        """Whether the answer was cut at ``max_new_tokens``."""
        return self.ended == "length"


OnText = Callable[[str], object]
"""A callable given each new piece of an answer's text as it is decoded."""


class TextStream:
    """Pieces of a growing text for ``on_text``, each a prefix-safe delta: nothing handed on
    is later taken back. Held back until more text (or :meth:`finish`) settles them: a
    partial UTF-8 character (decoded as U+FFFD), any end of the text that could still be the
    start of a stop string, and, for a tokenizer that cleans up spaces when decoding
    (``" ."`` -> ``"."``), everything from the last whitespace on. :meth:`finish` hands on the
    rest of the final text (cut before a stop string): the pieces concatenate to it exactly.
    ``on_text`` is called only with non-empty pieces."""

    def __init__(self, on_text: OnText, stops: Sequence[str], cleans_spaces: bool) -> None:
        self.on_text = on_text
        self.stops = tuple(stops)
        self.cleans_spaces = cleans_spaces
        self.sent = ""

    def update(self, text: str) -> None:
        """The text decoded so far: hand on what of it is settled."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        end -= max((_stop_start(text[:end], s) for s in self.stops), default=0)
        if self.cleans_spaces:
            spaces = [i for i in range(end) if text[i].isspace()]
            end = spaces[-1] if spaces else 0
        self._send(text, end)

    def finish(self, text: str) -> None:
        """The final text: hand on all of it that was not handed on."""
        self._send(text, len(text))

    def _send(self, text: str, end: int) -> None:
        if end <= len(self.sent) or not text.startswith(self.sent):
            return
        piece = text[len(self.sent) : end]
        self.sent = text[:end]
        self.on_text(piece)


def _stop_start(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that is the start of ``stop`` (0: none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class Stripped:
    """``on_text`` given the pieces of a text stripped of its surrounding whitespace (as
    :meth:`kvedit.Memory.ask` returns it): leading whitespace dropped, whitespace held until
    more text follows it (what is left at the end is dropped)."""

    def __init__(self, on_text: OnText) -> None:
        self.on_text = on_text
        self.started = False
        self.pending = ""

    def __call__(self, piece: str) -> None:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return
            self.started = True
        body = piece.rstrip()
        if body:
            self.on_text(self.pending + body)
            self.pending = piece[len(body) :]
        else:
            self.pending += piece


def check_on_text(on_text: object) -> None:
    """Refuse an ``on_text`` that is neither None nor callable, before any work.

    Raises:
        InvalidTypeError: it is not.
    """
    if on_text is not None and not callable(on_text):
        raise InvalidTypeError(f"on_text must be callable or None, not {checks.describe(on_text)}")


def stops_of(own: Sequence[str], stop: Sequence[str] | None) -> tuple[str, ...]:
    """The stop strings of an answer: the prompt format's ``own``, then ``stop``.

    Raises:
        InvalidInputError: ``stop`` is not a list of non-empty strings.
    """
    if stop is None:
        stop = ()
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidInputError(f"stop must be a list of non-empty strings, not {stop!r}")
    return (*own, *stop)


def focused_on(
    held: KVState, question: str, p: Rendering, guard: Guard, rendering: Rendering
) -> Focus | None:
    """Focus run over ``held`` (a memory's state, rendered as ``rendering``) for
    ``question`` (``p``: the rendering with the question and the generation prompt): its
    :class:`~kvedit.Focus` (None when no message holds a passage). Nothing is changed:
    :meth:`kvedit.Memory.ask` keeps it in ``last_focus`` once it succeeds."""
    passages = [r for r in rendering.contents if r is not None]
    if not passages:
        return None
    return focus(held, p.text[len(rendering.text) :], passages, query=question, guard=guard)


def _seen(state: KVState, eos: set[int]) -> torch.Tensor:
    """The tokens before an answer a repetition penalty counts (the last
    :data:`~kvedit.states.decoding.PENALTY_WINDOW` of ``state``'s), the EOS ids left out."""
    window = state.token_ids[-PENALTY_WINDOW:].to(torch.long)
    if eos:
        window = window[~torch.isin(window, torch.tensor(sorted(eos), dtype=torch.long))]
    return window


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
    repetition_penalty: float = 1.0,
    on_text: OnText | None = None,
) -> Decoded:
    """Decode from ``state`` (which ends with the generation prompt) until EOS, a stop string
    or ``max_new_tokens``; the answer's text is cut before the first stop string. The sampling
    arguments are checked (:class:`~kvedit.states.decoding.Sampling`) before any work; a
    ``repetition_penalty`` counts every token of the answer so far and the last
    :data:`~kvedit.states.decoding.PENALTY_WINDOW` tokens of ``state`` (the EOS ids never).
    ``on_text`` is given the answer's text as it is decoded (:class:`TextStream`: pieces that
    concatenate to the returned ``text``); the answer is the same with or without it."""
    sampling = Sampling(do_sample, temperature, top_k, top_p, generator, repetition_penalty)
    sampling.check_device(state.last_logits.device)
    check_on_text(on_text)
    dec = Decoder(state, max_new_tokens=max_new_tokens)
    eos = eos_ids(dec.model, dec.tokenizer)
    penalized = sampling.repetition_penalty != 1.0
    before = _seen(state, eos) if penalized else None
    cleans = bool(getattr(dec.tokenizer, "clean_up_tokenization_spaces", False))
    stream = None if on_text is None else TextStream(on_text, stops, cleans)
    tokens: list[int] = []
    ended = "length"
    for step in range(max_new_tokens):
        seen = torch.cat([before, torch.tensor(tokens, dtype=torch.long)]) if penalized else None
        token = sampling.pick(dec.next_logits, seen)
        if token in eos:
            ended = "eos"
            break
        tokens.append(token)
        text = dec.tokenizer.decode(tokens, skip_special_tokens=True)
        if stops and any(s in text for s in stops):
            ended = "stop"
            break
        if stream is not None:
            stream.update(text)
        if step < max_new_tokens - 1:
            dec.push(token)
    text = dec.tokenizer.decode(tokens, skip_special_tokens=True)
    if ended == "stop":
        text = text[: min(text.find(s) for s in stops if s in text)]
    if stream is not None:
        stream.finish(text)
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
