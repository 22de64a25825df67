"""A conversation kept as one exact cache: :class:`Memory`.

Each :meth:`Memory.add` renders the whole conversation (:mod:`kvedit.memory.rendering`),
checks that the ids the cache holds are a prefix of the new rendering's ids (and its text a
prefix of the new text), and runs only the new ids through the model; :meth:`Memory.ask`
decodes an answer and commits it the same way, keeping the decoded tokens' K/V
(:mod:`kvedit.memory.answering`). Without a budget nor ``quantize`` the cache is at every turn
what a fresh :func:`kvedit.capture_tokens` of the rendering's ids would hold (the same ids, the
same digest, logits equal up to float rounding): a plain capture of the transcript, which
:class:`kvedit.KVStore` takes and :func:`kvedit.reuse` finds as a prefix. Under a budget
(:mod:`kvedit.memory.budget`) each message (and each kept answer) that takes it past the budget
is followed by a forgetting round, the new entries ranked with the old; ``quantize`` holds the
older messages in low bits (:mod:`kvedit.memory.quantizing`); the history records both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .. import checks
from ..errors import InvalidInputError
from ..focusing.choice import Focus
from ..focusing.guard import Guard
from ..spans import Spans
from ..states.capturing import empty_state, extend_ids
from ..states.decoding import Sampling
from ..states.state import KVState
from .answering import (
    Answered,
    Stripped,
    answer_turns,
    check_on_text,
    commit,
    decode,
    focused_on,
    guard_of,
    stops_of,
)
from .budget import RECENT_TOKENS, budget_from
from .explaining import explain_text, focus_said
from .extending import MemoryExtendMethods
from .folding import fold_turn
from .forgetting import Round
from .held import Held, Scores, bytes_per_token, check_model
from .persisting import MemoryFileMethods
from .protection import check_system_held
from .quantizing import Packing, check_bits, exact_messages_of, hold_older_quantized
from .records import MAX_MESSAGES, Turn
from .rendering import (
    ROLES,
    Message,
    Rendering,
    check_append_only,
    check_readable,
    renderer_for,
)
from .repositioning import check_room_after, with_room
from .smallest import check_holds, system_head
from .undoing import UNDO_STEPS, MemoryUndoMethods

__all__ = ["MAX_MESSAGES", "UNDO_STEPS", "Memory"]


class Memory(MemoryFileMethods, MemoryUndoMethods, MemoryExtendMethods):
    """A conversation an agent keeps as one exact KV cache.

    ``Memory(model, tokenizer, system=..., prompt="chat")`` renders messages with the
    tokenizer's chat template (``"plain"``: the documented format for base models,
    :mod:`kvedit.memory.rendering`; default: ``"chat"`` when the tokenizer has a template,
    else ``"plain"``). A ``system`` text is the first message, computed now.
    ``max_positions``: the most positions the model attends to (default: its config's), for
    a model whose config understates its context; every message and answer is refused before
    any work when it would run past it.

    Forgetting (:mod:`kvedit.memory.forgetting`): with ``max_tokens`` (the entries a
    global-attention layer holds, on average, when a question comes; the question and its
    answer on top) or ``max_bytes`` (the bytes the cache allocates, never exceeded after a
    message), a message (or a kept answer) that takes the memory past its budget is followed
    by a round that forgets what is over it, the new entries ranked with the old, with the
    ``forget`` policy (any registered scorer; None:
    :data:`~kvedit.memory.forgetting.DEFAULT_POLICY` where a fit exists for the model, else
    :data:`~kvedit.memory.forgetting.FALLBACK_POLICY`); the first tokens, the system message,
    the last ``recent_tokens`` tokens and the ``protect`` spans are never forgotten.
    ``keep`` (:data:`~kvedit.memory.keeping.KEEPS`; ``per_head=``/``per_layer=``, its older
    keywords): ``"head"``, each KV head keeps its own entries; ``"layer"``, each global layer
    its own, the same on every head; ``"token"``, the same tokens on every global layer (what
    ``kvedit serve``'s memories hold: a stock kernel serves one slot per token for all layers);
    ``"auto"`` (the default): ``"head"`` where the policy allows it. A budget the memory can
    never hold (under its sliding windows, its protected part and one token more:
    :func:`~kvedit.memory.smallest.smallest_budget`) is refused here, before any work.
    Each round is a history step (the memory is no longer a plain capture) and a
    :class:`~kvedit.memory.forgetting.Round` in :attr:`forgetting`. ``quantize`` (2, 4 or 8)
    holds the messages before the last ``exact_messages`` (``recent=``, its older name) in that
    many bits (:mod:`kvedit.memory.quantizing`), with or without a budget. Under a budget the
    memory goes on past the model's positions: ``reposition`` (``"at_limit"``, ``"always"``,
    ``"never"``: :mod:`kvedit.memory.repositioning`) gives the kept entries compact positions.
    ``layer_floor`` (in [0, 1), default 0): the fraction of a round's room shared equally among
    the global layers before one ranking spends the rest (:func:`~kvedit.memory.forgetting.forget`).

    Every message is computed once: :meth:`add` runs only its own tokens, :meth:`ask` runs the
    question and keeps the answer's decoded K/V. A failed call leaves the memory as it was;
    :meth:`undo` takes back the last :data:`UNDO_STEPS` changes, one at a time.
    """

    def __init__(
        self,
        model,
        tokenizer,
        system: str | None = None,
        prompt: str | None = None,
        *,
        max_positions: int | None = None,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        forget: str | None = None,
        recent: int | None = None,
        protect: Spans | None = None,
        quantize: int | None = None,
        recent_tokens: int = RECENT_TOKENS,
        per_head: bool | None = None,
        per_layer: bool | None = None,
        keep: str | None = None,
        exact_messages: int | None = None,
        reposition: str | None = None,
        layer_floor: float = 0.0,
    ) -> None:
        check_model(model, tokenizer)
        if prompt is None:
            prompt = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        self.renderer = renderer_for(prompt, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        state = empty_state(model, tokenizer, max_positions=max_positions)
        self._held = Held(state, (), self.renderer.render([]), (), ())
        self.quantize = check_bits(quantize)
        """Bits the messages before the last :attr:`exact_messages` are held in (None: all
        exact)."""
        self.budget = budget_from(
            state,
            max_tokens=max_tokens,
            max_bytes=max_bytes,
            forget=forget,
            recent_tokens=recent_tokens,
            protect=protect,
            keep=keep,
            quantize=self.quantize,
            per_head=per_head,
            per_layer=per_layer,
            reposition=reposition,
            layer_floor=layer_floor,
        )
        """The :class:`~kvedit.memory.budget.Budget` (None: nothing is ever forgotten)."""
        self.exact_messages = exact_messages_of(exact_messages, recent)
        """The last messages ``quantize`` holds exact (``recent=``, the older keyword)."""
        if self.budget is not None:  # refused before the system message runs
            said = None if system is None else self._message("system", system).content
            head = system_head(self.renderer, said)
            check_holds(self.budget, self._state, system_tokens=head, quantize=self.quantize)
        self.last_focus: Focus | None = None
        """The :class:`~kvedit.Focus` of the last :meth:`ask` with focus that succeeded (None
        before, or when no message held a passage)."""
        self.last_answer: Answered | None = None
        """The last answer :meth:`ask` gave (:class:`~kvedit.memory.answering.Answered`: its
        text, its tokens and why it ended: ``"eos"``, ``"stop"`` or ``"length"``, cut at
        ``max_new_tokens``); None before the first."""
        self._files: dict[str, tuple | None] = {}  # file -> the version loaded or saved last
        self.scoring_seconds = 0.0
        """Seconds an arrival policy spent scoring the messages as they came (this process)."""
        self.reposition_seconds = 0.0
        """Seconds spent giving the entries compact positions (this process)."""
        if system is not None:
            self.add("system", system)

    @property
    def prompt(self) -> str:
        """The prompt format's name (``"chat"`` or ``"plain"``)."""
        return self.renderer.name

    @property
    def state(self) -> KVState:
        """The cache of the whole conversation (a :class:`~kvedit.KVState`, never edited)."""
        return self._state

    @property
    def turns(self) -> tuple[Turn, ...]:
        """One :class:`~kvedit.memory.records.Turn` per message, in order."""
        return tuple(self._turns)

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    @property
    def forgetting(self) -> tuple[Round, ...]:
        """The forgetting rounds so far (:class:`~kvedit.memory.forgetting.Round`), in order."""
        return tuple(self._rounds)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (keys, values; every layer)."""
        return self._state.nbytes

    def __len__(self) -> int:
        return len(self._messages)

    def __repr__(self) -> str:
        return (
            f"Memory({len(self._messages)} messages, {len(self._state)} tokens, "
            f"{self.nbytes / 2**20:.1f} MiB, prompt {self.prompt!r})"
        )

    def add(self, role: str, content: str) -> Turn:
        """Add one message and compute only its tokens. Returns its :class:`Turn`.

        Raises:
            InvalidInputError: an unknown role, an empty message, a message past the model's
                positions (refused before any work).
            TemplateError: the template rewrites earlier text when the message follows.
        """
        message = self._message(role, content)
        self._check_count()
        rendering = self._render_after([*self._messages, message], message.role)
        check_system_held(self.budget, self.prompt, self._messages, rendering)
        n = len(self._state)
        base = self._room(len(rendering.ids) - n, 0, f"{role} message")
        state = extend_ids(base, rendering.ids[n:], rendering.offsets[n:], rendering.text)
        end = len(rendering.ids)
        turn = Turn(len(self._messages), role, message.content, n, end, "computed", end - n)
        state, scores, rounds = self._fit(state, self._held.scores, n, [message], rendering, [turn])
        self._keep(state, [message], rendering, [turn], rounds, scores)
        return turn

    def _fit(
        self,
        state: KVState,
        scores: Scores | None,
        start: int,
        messages: list[Message],
        rendering: Rendering,
        turns: list[Turn],
    ) -> tuple[KVState, Scores | None, list[Round]]:
        """``(state, scores, rounds)``: ``state`` (the memory with ``messages`` just added from
        token ``start``, as ``rendering`` renders them all) folded in
        (:func:`~kvedit.memory.folding.fold_turn`: scored on arrival after ``scores``, the kept
        scores, and fitted to the budget); the memory itself is changed only when the message is
        kept."""
        every, said = [*self._turns, *turns], [*self._messages, *messages]
        packing = None
        if self.budget is not None and self.quantize is not None:
            packing = Packing(self.quantize, [t.start for t in every], self.exact_messages)
        done = fold_turn(self.budget, state, scores, start, every, said, rendering, packing=packing)
        self.scoring_seconds += done.scoring_seconds
        return done.state, done.scores, list(done.rounds)

    def _message(self, role: str, content: str) -> Message:
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidInputError(f"role must be one of {list(ROLES)}, not {role!r}")
        content = checks.text(f"the {role} message", content)
        if not content.strip():
            raise InvalidInputError(f"the {role} message is empty")
        check_readable(f"the {role} message", content)
        what, n_chars = f"{role} message", len(content)
        check_room_after(self._state, self._reposition, 0, what=what, n_chars=n_chars)
        return Message(role, content)

    _reposition = property(lambda self: "never" if self.budget is None else self.budget.reposition)

    def _room(self, n_tokens: int, reserve: int, what: str) -> KVState:
        """The state to add ``n_tokens`` (and ``reserve`` more) to: the memory's, given compact
        positions where its budget says (:func:`~kvedit.memory.repositioning.with_room`)."""
        t0 = time.perf_counter()
        state = with_room(self._state, self._reposition, n_tokens, reserve, what=what)
        if state is not self._state:
            self.reposition_seconds += time.perf_counter() - t0
        return state

    def _check_count(self, more: int = 1) -> None:
        if len(self._messages) + more > MAX_MESSAGES:
            raise InvalidInputError(
                f"a memory holds at most {MAX_MESSAGES} messages; it has {len(self._messages)}"
            )

    def _render_after(
        self, messages: Sequence[Message], what: str, generation_prompt: bool = False
    ) -> Rendering:
        """The rendering of ``messages``, refused unless the cache's ids (and text) are a
        prefix of it and it adds tokens."""
        rendering = self.renderer.render(messages, generation_prompt, after=self._rendering)
        self._check_prefix(self._rendering, rendering, what)
        return rendering

    def _check_prefix(self, held: Rendering, new: Rendering, what: str) -> None:
        check_append_only(held, new, what, self.prompt, self.tokenizer)

    def _keep(
        self,
        state: KVState,
        messages: list[Message],
        rendering: Rendering,
        turns: list[Turn],
        rounds: Sequence[Round] = (),
        scores: Scores | None = None,
    ) -> None:
        """Make the new state the memory's, after all work is done: one assignment, so an
        interrupt (Ctrl-C) leaves the memory as it was before or as it is after. With
        ``quantize``, the messages before the last ``recent`` are held in its bits first."""
        if self.quantize is not None:
            starts = [t.start for t in (*self._turns, *turns)]
            packed = bool(rounds) and self.budget is not None and self.budget.max_bytes is not None
            forgot = bool(rounds) and not packed  # a byte budget's round packed it already
            state = hold_older_quantized(state, self.quantize, starts, self.exact_messages, forgot)
        per_token = bytes_per_token(state)
        turns = [t.with_nbytes(round(per_token * t.n_tokens)) for t in turns]
        self._replace_held(
            Held(
                state,
                (*self._messages, *messages),
                rendering,
                (*self._turns, *turns),
                (*self._rounds, *rounds),
                scores,
            )
        )

    # the memory's fields, read from its one snapshot
    _state = property(lambda self: self._held.state)
    _messages = property(lambda self: self._held.messages)
    _rendering = property(lambda self: self._held.rendering)
    _turns = property(lambda self: self._held.turns)
    _rounds = property(lambda self: self._held.rounds)

    @torch.no_grad()
    def ask(
        self,
        question: str,
        max_new_tokens: int = 64,
        *,
        focus: bool | Guard = False,
        stop: Sequence[str] | None = None,
        remember: bool = True,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        repetition_penalty: float = 1.0,
        on_text: Callable[[str], object] | None = None,
    ) -> str:
        """Ask ``question`` as a user message and return the answer's text (stripped of
        surrounding whitespace, as it is committed).

        The answer ends at EOS, a stop string (``stop``, plus the prompt format's own: the
        ``"plain"`` format's next message label) or ``max_new_tokens``; a cut answer is
        still a whole message. With ``remember`` (the default) the question and the answer
        are added to the memory, the answer's decoded K/V kept (:mod:`kvedit.memory.answering`);
        otherwise the memory is left as it was. Under a budget (``max_tokens``/``max_bytes``)
        the question and the answer come on top of what the memory holds; a remembered answer
        is then followed by a forgetting round if the memory is over its budget.

        ``focus``: ``True`` (with :data:`kvedit.DEFAULT_GUARD`) or a guard emphasizes the
        messages the question points at (:func:`kvedit.focus`, the messages' contents as
        passages) for this answer only: the memory itself is never edited, and what is
        committed is what an unedited memory would hold (the question and the answer are run
        again over it; :attr:`Turn.recomputed` says so). :attr:`last_focus` keeps the choice.

        ``repetition_penalty`` (1.0: off; in ``(0, 10]``): the logits of the answer's tokens so
        far and of the last 64 tokens before it (the EOS ids never) divided by it where
        positive, multiplied where negative (:class:`~kvedit.states.decoding.Sampling`).
        ``on_text``: called with each new piece of the answer's text as it is decoded; the
        pieces concatenate to exactly the text returned (nothing handed on is taken back: a
        partial character, the start of a possible stop string and surrounding whitespace
        wait for what follows). The answer is the same with or without it.
        :attr:`last_answer` says why the answer ended; :meth:`undo` takes a remembered
        question and answer back.

        Raises:
            InvalidInputError: an empty question, a bad argument (``remember`` not a bool,
                sampling arguments: :class:`~kvedit.states.decoding.Sampling`), or a question
                and answer past the model's positions (before any work).
            TemplateError: the template is not append-only with the question or the answer,
                or refuses the conversation itself.
        """
        remember = checks.flag("remember", remember)
        sampling = Sampling(do_sample, temperature, top_k, top_p, generator, repetition_penalty)
        check_on_text(on_text)
        sampling.check_device(self._state.last_logits.device)
        guard = guard_of(focus, self._state)
        max_new_tokens = checks.count("max_new_tokens", max_new_tokens, minimum=1)
        stops = stops_of(self.renderer.stops, stop)
        message = self._message("user", question)
        self._check_count(2)
        asked = [*self._messages, message]
        q = self._render_after(asked, "question")
        check_system_held(self.budget, self.prompt, self._messages, q)
        p = self.renderer.render(asked, generation_prompt=True, after=q)
        self._check_prefix(q, p, "generation prompt")
        n, n_q, n_p = len(self._state), len(q.ids), len(p.ids)
        held = self._room(n_p - n, max_new_tokens, "question")  # the budget's, and more
        found = None if guard is None else focused_on(held, question, p, guard, self._rendering)
        focused = found is not None and bool(found.chosen) and found.kept
        prompt = extend_ids(found.state if focused else held, p.ids[n:], p.offsets[n:], p.text)
        streamed = None if on_text is None else Stripped(on_text)
        decoded = decode(prompt, max_new_tokens, stops, **vars(sampling), on_text=streamed)
        text = decoded.text.strip()
        last_focus = self.last_focus if guard is None else found  # kept once the ask succeeds
        answered = Answered(text, len(decoded.token_ids), decoded.ended)
        if not remember:
            self.last_focus, self.last_answer = last_focus, answered
            return text
        if not text:  # an empty answer is still a whole message
            text = decoded.text or " "
        answer = Message("assistant", text)
        full = self.renderer.render([*asked, answer], after=q)
        self._check_prefix(p, full, "answer")
        done = commit(held, prompt, decoded, full, focused=focused)
        turns = answer_turns(message, answer, len(self._messages), (n, n_q, n_p), full, done)
        state, scores, rounds = self._fit(
            done.state, self._held.scores, n, [message, answer], full, turns
        )
        self._keep(state, [message, answer], full, turns, rounds, scores)
        self.last_focus, self.last_answer = last_focus, answered
        return answer.content.strip()

    def explain(self) -> str:
        """Per message: role, tokens, computed / kept / loaded, bytes; the memory's size; the
        forgetting rounds; and what focus chose for the last question asked with focus."""
        return explain_text(
            repr(self),
            self._turns,
            self._rounds,
            self.budget,
            self._messages,
            self._rendering,
            self._state,
            self.focus_said(),
        )

    def focus_said(self) -> str | None:
        """What focus did for the last question asked with ``focus`` (:attr:`last_focus`), in
        words: the messages it emphasized, the guard's verdict where it dropped the edit, or
        why it abstained; None when no question was asked with focus."""
        return focus_said(self.last_focus, self._rendering.contents, self._messages)
