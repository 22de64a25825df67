"""Adding many messages to a :class:`kvedit.Memory` at once: :meth:`~MemoryExtendMethods.extend`.

``extend(messages)`` gives exactly what calling :meth:`~kvedit.Memory.add` for each message
gives (the same token ids, turns, history and so digest, rounds; K/V equal up to float
rounding) with fewer forward passes:

- Everything is checked first, as each ``add`` would check it, before any work: each
  message (its role, its text; a bad one named by its index in the batch), the message count,
  the conversation rendered through each message in turn exactly as ``add`` renders it
  (append-only, the system message held under a budget: these renderings give each message's
  boundaries) and, where the memory never moves its positions, the model's positions for the
  whole batch.
- The whole batch is rendered once more with the memory's renderer; where its ids are those
  of the renderings one by one (every registered renderer), consecutive messages are run as
  one prefill (chunks of at most :data:`PREFILL_TOKENS`), else one message at a time.
- Without a budget that is one group. Under a budget a group ends before the message that
  would take the memory past it (known from token counts: a global layer holds ``k`` more
  entries after ``k`` tokens, the cache :func:`~kvedit.memory.budget.added_bytes` more bytes);
  that message is added alone and followed by its round, as ``add`` does. A group's state is
  checked to be within the budget after it is computed (the counts only grow along a group, so
  no round was skipped inside it); one that is not is computed again a message at a time.
  An arrival policy's scores are computed for a group's tokens at once only where they depend
  on each entry's own key and value alone (:data:`GROUPED_ARRIVALS`); any other arrival
  policy (``kvzip`` re-reads each message as its own chunk) is run a message at a time.
- ``quantize=`` memories are added a message at a time (their older messages are packed
  after each one), and so is a batch during which the adds would give the memory compact
  positions (:mod:`kvedit.memory.repositioning`: ``reposition="always"``, or the batch past
  the positions left): each ``add`` makes its own room, or refuses it (the memory restored).

The memory is changed once, at the end (an error or Ctrl-C leaves it as it was), and
:meth:`~kvedit.Memory.undo` takes the whole batch back as one change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import checks
from ..errors import InvalidInputError, InvalidTypeError, TemplateError
from ..states.capturing import extend_ids
from ..states.state import KVState
from .budget import Budget, added_bytes
from .forgetting import Round, global_entries
from .held import Held, Scores, bytes_per_token
from .protection import check_system_held
from .records import Turn
from .rendering import Message, Rendering, check_append_only
from .repositioning import fits

__all__ = ["GROUPED_ARRIVALS", "PREFILL_TOKENS", "MemoryExtendMethods"]

PREFILL_TOKENS = min(2048, checks.MAX_TOKENS_PER_CALL)
"""The most tokens one forward pass of :meth:`~MemoryExtendMethods.extend` runs: a longer group
is run in chunks, so that the attention's scores of a chunk over the cache (chunk x cache x
heads) stay small; a chunk costs one copy of the cache."""

GROUPED_ARRIVALS = frozenset({"learned"})
"""The arrival policies whose scores of an entry depend only on the entry's own key and value,
so that scoring a group of messages at once gives each message's scores as it arrived alone."""


@dataclass(frozen=True)
class _Batch:
    """A batch checked and rendered before any work: the messages, the conversation rendered
    through each of them in turn (as ``add`` renders it), and whether the batch rendered at
    once gives the same ids (then messages may be run together)."""

    messages: tuple[Message, ...]
    renderings: tuple[Rendering, ...]
    together: bool

    @property
    def ends(self) -> list[int]:
        """Where each message's tokens end (its rendering's length)."""
        return [len(r.ids) for r in self.renderings]


@dataclass(frozen=True)
class _Work:
    """What an extend has computed so far (the memory itself unchanged): the state, its
    arrival scores, and the batch's messages, turns and rounds added to it."""

    state: KVState
    scores: Scores | None
    messages: tuple[Message, ...] = ()
    turns: tuple[Turn, ...] = ()
    rounds: tuple[Round, ...] = ()


class MemoryExtendMethods:
    """What :class:`kvedit.Memory` does to add many messages at once (it holds ``_held``,
    ``budget``, ``quantize``, ``renderer``, ``prompt`` and ``tokenizer``, and has ``add``,
    ``_message``, ``_check_count``, ``_fit`` and ``_replace_held``)."""

    def extend(self, messages: Iterable[tuple[str, str] | Message]) -> list[Turn]:
        """Add ``messages`` (``(role, content)`` pairs or
        :class:`~kvedit.memory.rendering.Message`\\ s, in order) in as few forward passes as
        the template and the budget allow, with exactly the result of calling :meth:`add` for
        each: the same ids, turns, history and digest, the same forgetting rounds at the same
        messages, K/V equal up to float rounding (module docstring). Returns their
        :class:`Turn`\\ s (an empty batch: ``[]``, nothing changed). The memory changes once,
        at the end; :meth:`undo` takes the whole batch back.

        Raises:
            InvalidTypeError: ``messages`` not an iterable of pairs or messages (naming the
                first bad item's index).
            InvalidInputError: a message ``add`` would refuse (an unknown role, an empty or
                unreadable text: named by its index in the batch), more messages than a memory
                holds, or the batch past the model's positions (naming the first message past
                them); all before any work, the memory unchanged.
            TemplateError: the template is not append-only with a message added (named by its
                index), before any work.
        """
        batch = self._batch_messages(messages)
        if not batch:
            return []
        self._check_count(len(batch))
        planned = self._rendered_batch(batch)
        if self._reposition == "never":
            self._check_batch_room(planned)
        if self.quantize is not None or self._moves_positions(planned):
            return self._added_one_by_one(planned)
        work = _Work(self._state, self._held.scores)
        grouped = planned.together and _groups_arrivals(self.budget, self._state)
        j = 0
        while j < len(batch):
            k = self._group_end(work.state, planned, j) if grouped else j + 1
            work = self._run_group(work, planned, j, k)
            j = k
        self._replace_held(  # one assignment, kept for undo
            Held(
                work.state,
                (*self._messages, *work.messages),
                planned.renderings[-1],
                (*self._turns, *work.turns),
                (*self._rounds, *work.rounds),
                work.scores,
            )
        )
        return list(work.turns)

    def _batch_messages(self, messages) -> list[Message]:
        """``messages`` as :class:`Message`\\ s, each checked as :meth:`add` checks it; a bad
        one refused naming its index."""
        if isinstance(messages, (str, bytes, Message)) or not isinstance(messages, Iterable):
            raise InvalidTypeError(
                "messages must be an iterable of (role, content) pairs or Messages, not "
                f"{checks.describe(messages)}"
            )
        out = []
        for k, item in enumerate(messages):
            if isinstance(item, Message):
                role, content = item.role, item.content
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                role, content = item
            else:
                raise InvalidTypeError(
                    f"message {k} of the batch must be a (role, content) pair or a Message, "
                    f"not {checks.describe(item)}; the memory is unchanged"
                )
            try:
                out.append(self._message(role, content))
            except InvalidInputError as e:
                raise type(e)(f"message {k} of the batch: {e}; the memory is unchanged") from None
        return out

    def _rendered_batch(self, batch: list[Message]) -> _Batch:
        """The conversation rendered through each message of ``batch`` in turn, checked as
        :meth:`add` checks it (append-only; the system message held under a budget), and the
        batch rendered at once, compared with the last of them."""
        held = self._rendering
        before = list(self._messages)
        renderings = []
        for k, message in enumerate(batch):
            what = f"message {k} of the batch ({message.role})"
            try:
                rendering = self.renderer.render([*before, message], after=held)
                check_append_only(held, rendering, what, self.prompt, self.tokenizer)
                check_system_held(self.budget, self.prompt, before, rendering)
            except TemplateError as e:
                raise TemplateError(f"{what}: {e}") from None
            renderings.append(rendering)
            before.append(message)
            held = rendering
        whole = self.renderer.render(before, after=self._rendering)
        last = renderings[-1]
        together = whole.ids == last.ids and whole.text == last.text
        return _Batch(tuple(batch), tuple(renderings), together)

    def _check_batch_room(self, planned: _Batch) -> None:
        """Refuse a batch past the model's positions, naming the first message past them
        (before any work): positions only grow, forgotten or not."""
        state = self._state
        n = len(state)
        for k, end in enumerate(planned.ends):
            if not fits(state, end - n):
                role = planned.messages[k].role
                state.check_room(end - n, what=f"batch through its message {k} ({role})")
                raise InvalidInputError(  # check_room refuses it first: this is the backstop
                    f"message {k} of the batch would run past the model's positions"
                )

    def _moves_positions(self, planned: _Batch) -> bool:
        """Whether adds would give the memory compact positions during the batch
        (:mod:`kvedit.memory.repositioning`: ``"always"``, or the batch past the positions
        left): it is then added a message at a time, each :meth:`add` making its room."""
        if self._reposition != "at_limit":
            return self._reposition == "always"
        return not fits(self._state, planned.ends[-1] - len(self._state))

    def _group_end(self, state: KVState, planned: _Batch, j: int) -> int:
        """Where the group from message ``j`` ends (exclusive): before the first message that
        would take ``state`` past the budget (that message alone when it is ``j``); the
        whole batch without a budget."""
        if self.budget is None:
            return len(planned.messages)
        n = len(state)
        for k, end in enumerate(planned.ends[j:], start=j):
            if _over_after(self.budget, state, end - n):
                return max(k, j + 1)
        return len(planned.messages)

    def _run_group(self, work: _Work, planned: _Batch, j: int, k: int) -> _Work:
        """``work`` with messages ``[j, k)`` of the batch computed in one prefill, scored as
        they arrive and fitted to the budget (a round only after the last); a group of several
        that is over the budget once computed is computed again a message at a time."""
        rendering = planned.renderings[k - 1]
        n = len(work.state)
        state = _prefill(work.state, rendering, n)
        if k - j > 1 and self.budget is not None and self.budget.over(state):
            for m in range(j, k):  # the counts misjudged: exactness first
                work = self._run_group(work, planned, m, m + 1)
            return work
        first = len(self._messages) + len(work.messages)
        starts = [n, *planned.ends[j : k - 1]]
        turns = tuple(
            Turn(first + i, m.role, m.content, s, e, "computed", e - s)
            for i, (m, s, e) in enumerate(
                zip(planned.messages[j:k], starts, planned.ends[j:k], strict=True)
            )
        )
        messages = (*work.messages, *planned.messages[j:k])
        all_turns = (*work.turns, *turns)
        state, scores, rounds = self._fit(
            state, work.scores, n, list(messages), rendering, list(all_turns)
        )
        per_token = bytes_per_token(state)  # as add's _keep measures its turn: after its round
        turns = tuple(t.with_nbytes(round(per_token * t.n_tokens)) for t in turns)
        return _Work(state, scores, messages, (*work.turns, *turns), (*work.rounds, *rounds))

    def _added_one_by_one(self, planned: _Batch) -> list[Turn]:
        """:meth:`add` for each message (a ``quantize=`` memory packs its older messages after
        each), the memory restored when one fails or is interrupted, the batch one change for
        :meth:`undo`."""
        before = self._held
        undo = getattr(self, "_undo", None)
        try:
            for m in planned.messages:
                self.add(m.role, m.content)
        except BaseException:
            self._held = before
            if undo is not None:
                self._undo = undo
            raise
        after = self._held
        if undo is not None:  # one change: the snapshot before the batch kept for undo
            self._held, self._undo = before, undo
            self._replace_held(after)
        return list(after.turns[-len(planned.messages) :])


def _groups_arrivals(budget: Budget | None, state: KVState) -> bool:
    """Whether messages may be run (and scored) together under ``budget``: its policy scores
    at rounds, or scores each entry from its own K/V (:data:`GROUPED_ARRIVALS`), and the model
    has global layers (what a budget counts grows by one entry per token)."""
    if budget is None:
        return True
    if not state.global_layers:
        return False
    return not budget.scorer.arrival or budget.policy in GROUPED_ARRIVALS


def _over_after(budget: Budget, state: KVState, n_new: int) -> bool:
    """Whether ``state`` with ``n_new`` more tokens would be over ``budget`` (a global layer
    holds one more entry per token on every KV head; the cache :func:`added_bytes` more)."""
    if budget.max_bytes is not None:
        return state.nbytes + added_bytes(state, n_new) > budget.max_bytes
    return global_entries(state) + n_new > budget.max_tokens


def _prefill(state: KVState, rendering: Rendering, start: int) -> KVState:
    """``state`` followed by ``rendering``'s ids from ``start`` on, run in chunks of at most
    :data:`PREFILL_TOKENS` tokens (each chunk's state holds ``rendering``'s text; only the
    last is kept)."""
    ids: Sequence[int] = rendering.ids
    for a in range(start, len(ids), PREFILL_TOKENS):
        b = min(a + PREFILL_TOKENS, len(ids))
        state = extend_ids(state, ids[a:b], rendering.offsets[a:b], rendering.text)
    return state
