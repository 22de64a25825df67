"""Chat conversations served from their memories: which memory serves a request
(:meth:`Conversations.plan`), and how a served turn becomes the next memory
(:meth:`Conversations.commit`). Used by ``kvedit serve``'s chat middleware
(:mod:`~kvedit.integrations.vllm.chat`) in the server process; needs the model's weights only for
its config, tokenizer, RoPE movers and the ``learned`` scorer's fit: nothing here runs the model.

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
:meth:`~Conversations.commit` moves the keys from vLLM's positions to the memory's (RoPE is
relative: by ``next_position - slots``, nothing when nothing was forgotten), appends them up to
where the conversation re-rendered with the answer differs (the answer's last sampled token has
no K/V yet: it is computed with the next message), scores them on arrival, fits the memory to
its byte budget (:class:`~kvedit.memory.budget.Budget` with ``per_head=False,
per_layer=False``: every layer and KV head keeps the same tokens, which a stock kernel, one slot
per token for all layers, serves exactly) and stores the result. The history records that vLLM computed entries
(a ``computed`` step): no served memory's digest claims a transformers capture.

Shapes: a saved turn's K/V are ``[n, kv_heads, head_dim]`` per layer; a memory's layers
``[1, kv_heads, entries, head_dim]``.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ... import rope
from ...errors import InvalidInputError, KVEditError
from ...memory.budget import RECENT_TOKENS, Budget, budget_from
from ...memory.held import Scores, arrived
from ...memory.protection import system_text_ranges
from ...memory.records import MAX_MESSAGES
from ...memory.rendering import Message, Rendering, common_prefix, renderer_for
from ...provenance import Step
from ...states.capturing import empty_state
from ...states.files.read import read_attached
from ...states.files.write import save_file_version
from ...states.state import KVState
from ...states.view import LastInput
from . import files
from .publishing import publish_stock
from .turns import SavedTurn, remove_turn, sweep_turns, wait_turn

__all__ = [
    "MAX_CONVERSATION_CHARS",
    "MEMORIES",
    "SERVABLE_POLICIES",
    "Conversations",
    "Plan",
    "check_max_bytes",
    "message_of",
    "served_policy",
]

MEMORIES = "memories"
"""The folder under the publish root that holds the conversations' memories."""

SERVABLE_POLICIES = ("learned", "knorm", "window")
"""Forgetting policies a served memory may use: they score entries from their K/V alone (the
others run the model, which the serving path never does)."""

MAX_CONVERSATION_CHARS = 4_000_000
"""The most characters a served conversation's messages hold: every turn renders them all (a
few seconds at this size), and a longer one is refused before any work."""

_ATTACHMENT = "kvedit-served-memory"
_RAM_BYTES = 1 << 30  # memories kept in this process after use: the next turn needs no read


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
    """

    messages: tuple[Message, ...]
    rendering: Rendering
    memory: Path | None
    digest: str | None
    slots: list[int]
    held: int
    turn: str
    max_bytes: int | None

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


@dataclass
class _Memory:
    state: KVState
    scores: Scores | None
    meta: dict = field(default_factory=dict)


class Conversations:
    """The memories of the conversations ``kvedit serve`` answers, under ``root`` (the publish
    root the connector loads from).

    Args:
        root: the publish root.
        model, tokenizer: the served model (a loaded kvedit model: its config, tokenizer,
            RoPE movers and scorer fit; never run).
        max_bytes: each conversation's byte budget (None: nothing is forgotten).
        forget: the policy (one of :data:`SERVABLE_POLICIES`; None: ``learned``).
        prompt: the prompt format (``"chat"``/``"plain"``; None: chat when the tokenizer has a
            template).
        timeout: seconds a commit waits for vLLM's worker to save a turn.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        model,
        tokenizer,
        *,
        max_bytes: int | None = None,
        forget: str | None = None,
        prompt: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.root = files.check_root(root)
        self.folder = self.root / MEMORIES
        self.folder.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer = model, tokenizer
        if prompt is None:
            prompt = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        self.renderer = renderer_for(prompt, tokenizer)
        self.forget = served_policy(forget)
        self._budget(max_bytes)  # checked before any work
        self.max_bytes = max_bytes
        self.timeout = float(timeout)
        self.index = files.PublishedIndex(self.folder)
        self.published = files.PublishedIndex(self.root)  # the memories' stock files
        self._ram: OrderedDict[str, _Memory] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ planning

    def _budget(self, max_bytes: int | None) -> Budget | None:
        """The budget of ``max_bytes`` (checked: a positive count of bytes), or None."""
        if check_max_bytes(max_bytes) is None:
            return None
        empty = empty_state(self.model, self.tokenizer)
        # one choice of tokens for every layer and head: vLLM serves it exactly (no null slots)
        return budget_from(
            empty, None, max_bytes, self.forget, RECENT_TOKENS, None, False, None, False
        )

    def plan(self, messages: Sequence[Mapping], params: object = None) -> Plan:
        """How to serve a chat request with ``messages`` (OpenAI's ``[{"role", "content"}]``,
        text only) and the client's ``kv_transfer_params`` (``{"kvedit": {"digest": D,
        "max_bytes": N}}``, both optional).

        Raises:
            InvalidInputError: messages kvedit cannot render (a non-text content, an unknown
                role), more than ``MAX_MESSAGES`` messages or
                :data:`MAX_CONVERSATION_CHARS` characters, bad kvedit parameters, or a named
                digest no memory of these messages has.
        """
        own = params.get("kvedit") if isinstance(params, dict) else None
        if own is not None and (not isinstance(own, dict) or set(own) - {"digest", "max_bytes"}):
            raise InvalidInputError(
                'a chat request\'s kv_transfer_params["kvedit"] takes "digest" and "max_bytes", '
                f"not {own!r}"
            )
        own = own or {}
        max_bytes = own.get("max_bytes", self.max_bytes)
        self._budget(max_bytes)  # checked before any work
        if not isinstance(messages, Sequence) or len(messages) > MAX_MESSAGES:
            raise InvalidInputError(f"a served conversation holds at most {MAX_MESSAGES} messages")
        parsed = tuple(message_of(m) for m in messages)
        chars = sum(len(m.content) for m in parsed)
        if chars > MAX_CONVERSATION_CHARS:
            raise InvalidInputError(
                f"the messages hold {chars} characters; a served conversation holds at most "
                f"{MAX_CONVERSATION_CHARS}"
            )
        rendering = self.renderer.render(parsed, generation_prompt=True)
        ids = list(rendering.ids)
        found = self._find(ids, own.get("digest"))
        turn = secrets.token_hex(16)
        sweep_turns(self.root)  # turns whose clients left
        if found is None:
            return Plan(parsed, rendering, None, None, [], 0, turn, max_bytes)
        path, held = found
        slots = self._slots(path)
        return Plan(parsed, rendering, path, files.digest_of(path), slots, held, turn, max_bytes)

    def _find(self, ids: list[int], digest: object) -> tuple[Path, int] | None:
        """``(memory file, tokens it holds)``: the named one, else the longest memory whose
        ids start ``ids`` (the whole prompt excluded: vLLM computes at least one token)."""
        if digest is not None:
            digest = files.check_digest(digest)
            got = self.index.find(ids[:-1], digest)
            if got is None:
                raise InvalidInputError(
                    f"no memory with digest {digest} under {self.folder} starts these messages"
                )
            return got
        found = self.index.candidates(ids[:-1])
        if found is None:
            return None
        n, paths = found
        return next(iter(paths.values())), n

    def _slots(self, path: Path) -> list[int]:
        """The stock slot ids of the memory in ``path`` (its published file's ids)."""
        digest = files.digest_of(path)
        published = self.published.with_digest(digest)
        if not published:
            raise KVEditError(f"the memory {digest} has no published stock file under {self.root}")
        return list(files.read_header(published[0][0])["token_ids"])

    # ------------------------------------------------------------------ committing

    def commit(self, plan: Plan, answer: str) -> dict[str, Any]:
        """Fold the turn ``plan`` served (vLLM saved its K/V; ``answer`` is the text it
        returned) into a new memory, fitted to the budget and stored. Returns what the response
        says (``memory_digest``, ``memory_bytes``, ``forgot``).

        Raises:
            KVEditError: the worker saved nothing (its reason), or the saved turn does not
                continue the memory.
        """
        try:
            saved = wait_turn(self.root, plan.turn, self.timeout)
            parent = self._load(plan.memory) if plan.memory is not None else None
            state, scores, forgot = self._next(plan, saved, answer, parent)
            digest = self._store(state, scores, plan)
        finally:
            remove_turn(self.root, plan.turn)
        return {"memory_digest": digest, "memory_bytes": state.nbytes, "forgot": forgot}

    def _next(
        self, plan: Plan, saved: SavedTurn, answer: str, parent: _Memory | None
    ) -> tuple[KVState, Scores | None, int]:
        base = parent.state if parent is not None else empty_state(self.model, self.tokenizer)
        n_held = len(base)
        if saved.start != len(plan.slots) or n_held != plan.held:
            raise KVEditError(
                f"turn {plan.turn}: vLLM saved tokens from {saved.start}, the memory has "
                f"{len(plan.slots)} slots for {plan.held} tokens"
            )
        # as kvedit.Memory keeps an answer: stripped (a cut answer's trailing space is not
        # part of what a client sends back), so the memory starts the next turn either way
        text = answer.strip() or answer or " "
        full = self.renderer.render([*plan.messages, Message("assistant", text)])
        tail = plan.rendering.ids[plan.held :]
        computed = [*base.token_ids.tolist(), *saved.token_ids]
        if saved.token_ids[: len(tail)] != tail:
            raise KVEditError(f"turn {plan.turn}: vLLM saved other tokens than the prompt's")
        m = common_prefix(computed, full.ids)
        keep = max(m - n_held, 0)
        shift = int(base.next_position) - saved.start  # vLLM's positions -> the memory's
        movers = rope.movers(self.model) if shift and keep else None
        index = torch.arange(n_held, n_held + keep)
        positions = torch.arange(base.next_position, base.next_position + keep)
        layers = []
        for i, layer in enumerate(base.layers):
            k = saved.keys[i][:keep].transpose(0, 1)[None]
            v = saved.values[i][:keep].transpose(0, 1)[None]
            if movers is not None:
                k = movers[i].move(k, torch.full((keep,), shift, dtype=torch.long))
            layers.append(layer.append(k, v, index, positions))
        n = n_held + keep
        state = base.replace(
            layers=layers,
            token_ids=torch.tensor(full.ids[:n], dtype=torch.long),
            offsets=full.offsets[:n].to(torch.long),
            text=full.text,
            position_ids=torch.cat([base.position_ids, positions]),
            next_position=int(base.next_position) + keep,
            last_logits=torch.zeros_like(base.last_logits),
            last_input=LastInput(n - 1, int(base.next_position) + keep - 1),
        ).with_step(Step("computed", "vllm", {"tokens": keep}, exact=False))
        budget = self._budget(plan.max_bytes)
        scores = arrived(budget, state, parent.scores if parent else None, n_held, n)
        if budget is None:
            return state, None, 0
        before = sum(len(x) for x in state.layers)
        ranges = _system_ranges(self.renderer, plan.messages, full)
        state, scores, _ = budget.fit(state, scores, ranges, len(plan.messages))
        return state, scores, before - sum(len(x) for x in state.layers)

    def _store(self, state: KVState, scores: Scores | None, plan: Plan) -> str:
        """Publish ``state``'s stock form and write the memory (both atomic; the memory last,
        so a memory found always has its stock file)."""
        _, stock, _ = publish_stock(state, self.root)
        digest = stock.digest or state.digest
        ids = state.token_ids.tolist()
        path = self.folder / files.file_name(ids, digest)
        attachment = {"kind": _ATTACHMENT, "parent": plan.digest, "max_bytes": plan.max_bytes}
        attached = {} if scores is None else {f"scores.{i}": t for i, t in scores.items()}
        save_file_version(state, path, attachment=attachment, attached=attached)
        self._remember(digest, _Memory(state, scores, attachment))
        self._prune(plan)
        return digest

    def _prune(self, plan: Plan) -> None:
        """Remove the memory two turns back (the parent of the one that served ``plan``): a
        conversation keeps its last two memories, so a turn retried is still served from its
        memory, and the files do not grow with every turn."""
        if plan.memory is None:
            return
        with self._lock:  # the commit has just loaded it
            parent = self._ram.get(plan.digest)
        old = parent.meta.get("parent") if parent is not None else None
        if not isinstance(old, str):
            return
        for index in (self.index, self.published):
            for path, _ in index.with_digest(old):
                path.unlink(missing_ok=True)
        with self._lock:
            self._ram.pop(old, None)

    def _load(self, path: Path) -> _Memory:
        digest = files.digest_of(path)
        with self._lock:
            if digest in self._ram:
                self._ram.move_to_end(digest)
                return self._ram[digest]
        found = read_attached(path, self.model, self.tokenizer)
        if not found.trusted or (found.attachment or {}).get("kind") != _ATTACHMENT:
            raise KVEditError(f"{path} is not a memory this installation served")
        tensors = found.tensors or {}
        scores = {
            int(k.split(".")[1]): t for k, t in tensors.items() if k.startswith("scores.")
        } or None
        memory = _Memory(found.state, scores, found.attachment)
        self._remember(digest, memory)
        return memory

    def _remember(self, digest: str, memory: _Memory) -> None:
        with self._lock:
            self._ram[digest] = memory
            self._ram.move_to_end(digest)
            while (
                len(self._ram) > 1 and sum(m.state.nbytes for m in self._ram.values()) > _RAM_BYTES
            ):
                self._ram.popitem(last=False)


def served_policy(forget: str | None) -> str:
    """The policy a served memory forgets with: ``forget`` (None: ``learned``).

    Raises:
        InvalidInputError: a policy that is not one of :data:`SERVABLE_POLICIES`.
    """
    policy = forget or "learned"
    if policy not in SERVABLE_POLICIES:
        raise InvalidInputError(
            f"forget={policy!r} cannot serve: a served memory forgets with one of "
            f"{list(SERVABLE_POLICIES)} (they score entries from their K/V; the others run "
            "the model, which the serving path never does)"
        )
    return policy


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


def _system_ranges(renderer, messages: Sequence[Message], full: Rendering) -> list[tuple[int, int]]:
    """The token ranges of the system messages (their turn and their text), kept by forgetting."""
    ranges = system_text_ranges(list(messages), full)
    if messages and messages[0].role == "system":
        ranges.append((0, len(renderer.render(list(messages[:1])).ids)))
    return ranges
