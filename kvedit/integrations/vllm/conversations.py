"""Chat conversations served from their memories: which memory serves a request
(:meth:`Conversations.plan`), and how a served turn becomes the next memory
(:meth:`Conversations.commit`). Used by ``kvedit serve``'s chat middleware
(:mod:`~kvedit.integrations.vllm.chat`) in the server process; the model's weights serve its
config, tokenizer, RoPE movers, the ``learned`` scorer's fit and, at a commit, the few tokens
that close an answer (:func:`~kvedit.integrations.vllm.committing.closed`).

**Memories.** A memory is a sealed state file under ``ROOT/memories``, named like a published
file by its token ids and its digest (``<n>-<ids key>-<digest>.safetensors``), so a request finds
the longest memory whose ids start its rendered messages (content-addressed: a client needs no
conversation id), or names one by digest (``kv_transfer_params={"kvedit": {"digest": D}}``).
Its stock form (:func:`~kvedit.integrations.vllm.publish_stock`) is published under ``ROOT`` with
the same digest, for the connector to load. A memory never changes: a turn makes a new one
(its ``parent`` named in the file), so two servers answering one conversation at once make two
memories, never a merged one. A conversation keeps its last two memories: storing one removes
its parent's parent (a retried turn is still served from its memory).

**A turn.** The engine's prompt is the memory's slots followed by the rest of the rendering
(the messages after what the memory holds and the generation prompt); vLLM computes only those
and the answer. The connector saves the K/V it computed (:mod:`~kvedit.integrations.vllm.turns`);
:meth:`~Conversations.commit` appends them to the memory, keys moved to its positions, and runs
the rest of the conversation re-rendered with the answer (the answer's last sampled token and
the closing markup, which vLLM has no K/V for yet) through the model
(:mod:`~kvedit.integrations.vllm.committing`), so the memory holds what :meth:`kvedit.Memory.ask`
commits. Then the one fold both follow (:func:`~kvedit.memory.folding.fold_turn`): scored on
arrival, fitted to the byte budget (``keep="token"``: every layer and KV head keeps the same
tokens, which a stock kernel serves exactly), the kept entries given compact positions
(:mod:`kvedit.memory.repositioning`: vLLM accepts up to ``max_model_len`` after the slots, so a
gap could be asked past the model's positions). The history records that vLLM computed entries
(a ``computed`` step, ``exact=False``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...compress import SCORERS
from ...errors import InvalidInputError, KVEditError
from ...memory.budget import RECENT_TOKENS, Budget, budget_from
from ...memory.folding import fold_turn, system_turns
from ...memory.held import Scores, scored_from_scratch
from ...memory.records import MAX_MESSAGES, Turn
from ...memory.rendering import Message, Rendering, check_readable, renderer_for
from ...memory.smallest import NEVER_HOLDS, smallest_budget, system_head
from ...states.capturing import empty_state
from ...states.state import KVState
from . import files
from .committing import appended, closed
from .memories import MEMORIES, Memory, MemoryFiles
from .turns import SavedTurn, remove_turn, sweep_turns, wait_turn

__all__ = [
    "MAX_CONVERSATION_CHARS",
    "MEMORIES",
    "Conversations",
    "Plan",
    "check_budget_holds",
    "check_max_bytes",
    "message_of",
    "servable_policies",
    "served_policy",
]

MAX_CONVERSATION_CHARS = 4_000_000
"""The most characters a served conversation's messages hold: every turn renders them all (a
few seconds at this size), and a longer one is refused before any work."""


@dataclass(frozen=True)
class Plan:
    """How one chat request is served.

    Attributes:
        messages: the request's messages.
        rendering: their rendering with the generation prompt.
        memory: the memory file that serves it (None: a new conversation, vLLM computes all).
        digest: that memory's digest (the published stock file's too).
        slots: the memory's stock slot ids (the engine prompt starts with them).
        held: the rendering's tokens the memory holds.
        turn: the id the connector saves this turn's K/V under.
        max_bytes: the conversation's byte budget (None: nothing is forgotten).
        budget: that budget, built once (None: nothing is forgotten).
        fallback: ``{"from": digest, "why": reason}`` when the conversation's latest memory was
            damaged and an earlier one serves (None otherwise).
    """

    messages: tuple[Message, ...]
    rendering: Rendering
    memory: Path | None
    digest: str | None
    slots: list[int]
    held: int
    turn: str
    max_bytes: int | None
    budget: Budget | None = None
    fallback: dict | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The engine's prompt: the memory's slots, then the rest of the rendering."""
        return [*self.slots, *self.rendering.ids[self.held :]]

    @property
    def kv_transfer_params(self) -> dict[str, Any]:
        """What the request hands vLLM: the prompt ids, the memory's digest and the turn."""
        own: dict[str, Any] = {"turn": self.turn}
        if self.digest is not None:
            own["digest"] = self.digest
        return {"prompt_token_ids": self.prompt_token_ids, "kvedit": own}


class Conversations:
    """The memories of the conversations ``kvedit serve`` answers, under ``root`` (the publish
    root the connector loads from).

    Args:
        root: the publish root.
        model, tokenizer: the served model (a loaded kvedit model: its config, tokenizer,
            RoPE movers and scorer fit; never run).
        max_bytes: each conversation's byte budget (None: nothing is forgotten).
        forget: the policy (one of :func:`servable_policies`; None: ``learned``).
        timeout: seconds a commit waits for vLLM's worker to save a turn.
        defer_writes: a commit makes the memory and writes it when the turn is dropped
            (:meth:`drop_turn`, once the response has ended) or the next request is planned,
            whichever comes first (kvedit serve's; False: at once).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        model,
        tokenizer,
        *,
        max_bytes: int | None = None,
        forget: str | None = None,
        timeout: float = 60.0,
        defer_writes: bool = False,
    ) -> None:
        self.root = files.check_root(root)
        self.model, self.tokenizer = model, tokenizer
        prompt = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        self.renderer = renderer_for(prompt, tokenizer)
        self.forget = served_policy(forget)
        self._empty = empty_state(model, tokenizer)
        # checked before any work (a budget that cannot hold the sinks and the recent tokens
        # of a conversation without a system message), built once
        self.budget = self._budget(max_bytes, SERVER_BUDGET)
        self.max_bytes = max_bytes
        self.timeout = float(timeout)
        self.defer_writes = bool(defer_writes)
        self.memories = MemoryFiles(self.root, model, tokenizer)
        self.folder = self.memories.folder

    # ------------------------------------------------------------------ planning

    def _budget(self, max_bytes: object, name: str, system_tokens: int = 0) -> Budget | None:
        """The budget of ``max_bytes`` (checked: a positive count of bytes that a memory of
        this model, with ``system_tokens`` of a system message, can hold), or None."""
        if check_max_bytes(max_bytes, name) is None:
            return None
        check_budget_holds(max_bytes, self._empty, system_tokens=system_tokens, name=name)
        # one choice of tokens for every layer and head: vLLM serves it exactly (no null slots)
        return budget_from(
            self._empty,
            max_tokens=None,
            max_bytes=max_bytes,
            forget=self.forget,
            recent_tokens=RECENT_TOKENS,
            protect=None,
            per_head=False,
            per_layer=False,
            reposition="always",
        )

    def plan(self, messages: Sequence[Mapping], params: object = None) -> Plan:
        """How to serve a chat request with ``messages`` (OpenAI's ``[{"role", "content"}]``,
        text only) and the client's ``kv_transfer_params`` (``{"kvedit": {"digest": D,
        "max_bytes": N}}``, both optional).

        Raises:
            InvalidInputError: messages kvedit cannot render (none, a non-text content, an
                unknown role, a lone surrogate), more than ``MAX_MESSAGES`` messages or
                :data:`MAX_CONVERSATION_CHARS` characters, bad kvedit parameters, a budget
                that can never hold this conversation (its system message and the recent
                tokens: :func:`check_budget_holds`, naming the smallest that holds), or a named
                digest no memory of these messages has.
            KVEditError: the named memory is damaged; ``ROOT/memories`` is not a folder.
        """
        own = params.get("kvedit") if isinstance(params, dict) else None
        if own is not None and (not isinstance(own, dict) or set(own) - {"digest", "max_bytes"}):
            raise InvalidInputError(
                'a chat request\'s kv_transfer_params["kvedit"] takes "digest" and "max_bytes", '
                f"not {own!r}"
            )
        own = own or {}
        max_bytes, budget = self.max_bytes, self.budget
        if "max_bytes" in own:
            max_bytes = check_max_bytes(own["max_bytes"], REQUEST_BUDGET)
        parsed = _parse(messages)
        # what no turn forgets: the system message (besides the first and the recent tokens)
        head = system_head(self.renderer, parsed[0].content) if parsed[0].role == "system" else 0
        if "max_bytes" in own:  # checked before any work, built once
            budget = self._budget(max_bytes, REQUEST_BUDGET, head)
        elif budget is not None and head:
            check_budget_holds(max_bytes, self._empty, system_tokens=head, name=SERVER_BUDGET)
        rendering = self.renderer.render(parsed, generation_prompt=True)
        digest = own.get("digest")
        digest = None if digest is None else files.check_digest(digest)
        self.memories.check_folder()
        self.memories.flush(timeout=self.timeout)  # the memories of turns answered
        sweep_turns(self.root)  # turns whose clients left
        self.memories.sweep()  # what killed writers left among the memories
        found = self.memories.find(list(rendering.ids), digest)
        turn = secrets.token_hex(16)
        if found is None:
            return Plan(parsed, rendering, None, None, [], 0, turn, max_bytes, budget)
        return Plan(
            parsed,
            rendering,
            found.path,
            found.digest,
            found.slots,
            found.held,
            turn,
            max_bytes,
            budget,
            found.fallback,
        )

    def drop_turn(self, turn: str) -> None:
        """Remove turn ``turn``'s saved files, whatever became of its request (idempotent;
        never raises: what cannot be removed now is swept later)."""
        self.memories.flush(turn, self.timeout)  # its memory, deferred past the response
        with contextlib.suppress(OSError):
            remove_turn(self.root, turn)

    # ------------------------------------------------------------------ committing

    def commit(self, plan: Plan, answer: str) -> dict[str, Any]:
        """Fold the turn ``plan`` served (vLLM saved its K/V; ``answer`` is the text it
        returned) into a new memory, fitted to the budget and stored (``defer_writes``: written
        by :meth:`drop_turn`). Returns what the response says (``memory_digest``, ...).

        Raises:
            KVEditError: the worker saved nothing (its reason), the memory that served the
                turn is not the plan's (its file changed), or the saved turn does not continue
                the memory.
        """
        try:
            saved = wait_turn(self.root, plan.turn, self.timeout)
            parent = None
            if plan.memory is not None:
                parent = self.memories.load(plan.memory, list(plan.rendering.ids))
            state, scores, forgot = self._next(plan, saved, answer, parent)
            made = self.memories.make(state, scores, plan.digest)
            if self.defer_writes:
                self.memories.defer(plan.turn, made, plan.digest)
            else:
                self.memories.write(made)
                self.memories.prune(plan.digest)
            digest = made.digest
        finally:
            remove_turn(self.root, plan.turn)
        return {"memory_digest": digest, "memory_bytes": state.nbytes, "forgot": forgot}

    def _next(
        self, plan: Plan, saved: SavedTurn, answer: str, parent: Memory | None
    ) -> tuple[KVState, Scores | None, int]:
        """``(state, scores, forgot)``: the memory after the turn, folded as
        :class:`kvedit.Memory` folds an answer (:func:`~kvedit.memory.folding.fold_turn`)."""
        base = parent.state if parent is not None else empty_state(self.model, self.tokenizer)
        if len(base) != plan.held:
            raise KVEditError(
                f"turn {plan.turn}: the memory {plan.memory} holds {len(base)} tokens, the plan "
                f"{plan.held}"
            )
        if saved.start != len(plan.slots):
            raise KVEditError(
                f"turn {plan.turn}: vLLM saved tokens from {saved.start}, the memory has "
                f"{len(plan.slots)} slots"
            )
        # as kvedit.Memory keeps an answer: stripped (a cut answer's trailing space is not
        # part of what a client sends back), so the memory starts the next turn either way
        said = Message("assistant", answer.strip() or answer or " ")
        messages = [*plan.messages, said]
        full = self.renderer.render(messages)
        vllm = appended(base, saved, plan.rendering.ids[plan.held :], full, plan.turn)
        state = closed(vllm, full)
        end = len(full.ids)
        turns = system_turns(self.renderer, plan.messages)
        turns += (
            Turn(len(plan.messages), "assistant", said.content, plan.held, end, "computed", 0),
        )
        scores = parent.scores if parent is not None else None
        if scores is None and len(base):  # a memory kept without this policy's scores (made
            # without a budget, or by another policy), as Memory.load scores a file's
            scores = scored_from_scratch(plan.budget, base)
        done = fold_turn(plan.budget, state, scores, plan.held, turns, messages, full, settle=True)
        return done.state, done.scores, done.forgot


def servable_policies() -> tuple[str, ...]:
    """The forgetting policies a served memory may use: the registered scorers that do not
    run the model (``reads_model`` False: they score entries from their K/V; the serving path
    never runs the model), in the registry's order."""
    return tuple(name for name in SCORERS if not SCORERS.lookup(name).reads_model)


def served_policy(forget: str | None) -> str:
    """The policy a served memory forgets with: ``forget`` (None: ``learned``).

    Raises:
        InvalidInputError: a policy that is not one of :func:`servable_policies`.
    """
    policy = "learned" if forget is None else forget
    servable = servable_policies()
    if policy not in servable:
        raise InvalidInputError(
            f"forget={policy!r} cannot serve: a served memory forgets with one of "
            f"{list(servable)} (they score entries from their K/V; the others run "
            "the model, which the serving path never does)"
        )
    return policy


SERVER_BUDGET = "the server's --memory-max-bytes"
REQUEST_BUDGET = 'kv_transfer_params["kvedit"]["max_bytes"]'


def check_budget_holds(
    max_bytes: int, source, *, system_tokens: int = 0, name: str = "max_bytes"
) -> None:
    """Refuse a served memory's byte budget under the smallest one a memory of ``source``'s
    model holds (:func:`~kvedit.memory.smallest.smallest_budget`: its sliding windows, the
    first tokens, ``system_tokens`` of a system message, the recent tokens and one more), so
    that no turn is answered and then not kept: before any work.

    Args:
        source: the model (a loaded kvedit model) or an empty state of it.
        system_tokens: the system message's tokens (:func:`~kvedit.memory.smallest.
            system_head`); 0: none.

    Raises:
        InvalidInputError: naming the budget, the smallest that holds and why.
    """
    least = smallest_budget(
        source, system_tokens=system_tokens, recent_tokens=RECENT_TOKENS, per_head=False
    )
    if max_bytes < least.max_bytes:
        system = " with this system message" if system_tokens else ""
        raise InvalidInputError(
            f"{name}={max_bytes:,} {NEVER_HOLDS}: the smallest budget a served memory of this "
            f"model{system} holds is {least.max_bytes:,} bytes ({least.why(RECENT_TOKENS)}); "
            f"raise {name}"
        )


def check_max_bytes(max_bytes: object, name: str = "max_bytes") -> int | None:
    """``max_bytes`` (None: no budget) if it is a positive int.

    Raises:
        InvalidInputError: anything else, named ``name``.
    """
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise InvalidInputError(f"{name} must be a positive int, not {max_bytes!r}")
    return max_bytes


def _parse(messages: object) -> tuple[Message, ...]:
    """A served conversation's messages, checked before any work (:func:`message_of`)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidInputError(f"a chat request's messages are a list, not {messages!r:.80}")
    if not messages:
        raise InvalidInputError("a chat request needs at least one message; it has none")
    if len(messages) > MAX_MESSAGES:
        raise InvalidInputError(f"a served conversation holds at most {MAX_MESSAGES} messages")
    parsed = tuple(message_of(m) for m in messages)
    chars = sum(len(m.content) for m in parsed)
    if chars > MAX_CONVERSATION_CHARS:
        raise InvalidInputError(
            f"the messages hold {chars} characters; a served conversation holds at most "
            f"{MAX_CONVERSATION_CHARS}"
        )
    for i, m in enumerate(parsed):
        check_readable(f"message {i} ({m.role})", m.content)
    return parsed


def message_of(m: object) -> Message:
    """One OpenAI chat message as kvedit renders it (text content only).

    Raises:
        InvalidInputError: not a system, user or assistant message of text.
    """
    if not isinstance(m, Mapping):
        raise InvalidInputError(f"a chat message must be an object, not {m!r}")
    role, content = m.get("role"), m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}]: text parts only
        if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            raise InvalidInputError("kvedit serves chat messages of text only")
        content = "".join(str(p.get("text", "")) for p in content)
    if role not in ("system", "user", "assistant") or not isinstance(content, str):
        raise InvalidInputError(
            f"kvedit serves system, user and assistant messages of text, not {role!r}"
        )
    return Message(role, content)
