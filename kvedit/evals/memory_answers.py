"""One method at one budget on one conversation of the memory suite (:mod:`kvedit.evals.memory`):
the memory the method makes (a budget in entries, or in bytes with ``in_bytes``), the messages
added, each question answered, and a record per question (the fields:
:mod:`kvedit.evals.memory`'s docstring); ``snapkv-first`` compresses once for the first
question, and the first questions of ``reuse`` are also answered by re-reading the transcript,
timed."""

from __future__ import annotations

import math
import time

from kvedit.evals.conversation_scores import exact_match, message_ends, token_f1
from kvedit.evals.memory_specs import MemoryMethod, budget_entries, full_entries
from kvedit.evals.metrics import best_subspan_em
from kvedit.evals.tasks.memory_schema import Conversation

__all__ = ["REREAD_TURNS", "default_renderer", "run_conversation"]

REREAD_TURNS = 3
"""The turns re-reading the transcript is timed on."""


def default_renderer(tokenizer):
    """The renderer a :class:`kvedit.Memory` of ``tokenizer`` uses by default."""
    from kvedit.memory.rendering import renderer_for

    return renderer_for("chat" if getattr(tokenizer, "chat_template", None) else "plain", tokenizer)


def _memory(model, tokenizer, method: MemoryMethod, budget: float, full: int):
    """The memory ``method`` runs at ``budget`` of a conversation of ``full`` entries: with
    ``max_tokens`` that fraction of the entries, or with ``in_bytes`` ``max_bytes`` that
    fraction of the bytes a memory forgetting nothing would allocate."""
    from kvedit.memory.budget import added_bytes
    from kvedit.memory.conversation import Memory

    if method.name == "snapkv-first":
        return Memory(model, tokenizer)
    keywords = method.memory_keywords()
    max_tokens = budget_entries(budget, full)
    if method.name == "reuse" or max_tokens is None:
        kept = {k: keywords[k] for k in ("recent", "quantize") if k in keywords}
        return Memory(model, tokenizer, **kept)
    if method.params.in_bytes:
        whole = added_bytes(Memory(model, tokenizer).state, full)
        return Memory(model, tokenizer, max_bytes=max(1, round(budget * whole)), **keywords)
    return Memory(model, tokenizer, max_tokens=max_tokens, **keywords)


def _held(state) -> list[float]:
    """The entries each global layer of ``state`` holds (per KV head, on average)."""
    from kvedit.memory.forgetting import layer_entries

    return [round(layer_entries(state, i), 2) for i in state.counted_layers]


def _holding(model, state) -> dict:
    """What ``state`` holds, as a record says it: ``entries`` (global layers, on average),
    ``entries_per_layer``, ``nbytes``, and the fractions of the model's own windowed cache for
    its tokens it keeps (:mod:`kvedit.memory.footprint`): ``own_entries_fraction`` (entries,
    every layer, sliding windows as the model holds them) and ``own_bytes_fraction``."""
    from kvedit.memory.footprint import held_entries, own_bytes, own_entries
    from kvedit.memory.forgetting import global_entries

    n = len(state)
    whole, whole_bytes = own_entries(model, n), own_bytes(model, n)
    return {
        "entries": global_entries(state),
        "entries_per_layer": _held(state),
        "nbytes": state.nbytes,
        "own_entries_fraction": round(held_entries(state) / whole, 4) if whole else None,
        "own_bytes_fraction": round(state.nbytes / whole_bytes, 4) if whole_bytes else None,
    }


def _snapkv_first_answers(
    memory, conversation: Conversation, budget: float, max_new_tokens: int, bits: int | None
):
    """Yield ``(answer, seconds, held)`` per question (``held``: :func:`_holding`): the memory's
    state compressed once by SnapKV with the first question as query (then quantized to
    ``bits`` when given), then reused (questions and answers appended to that state when the
    conversation keeps them)."""
    from kvedit.compress import SnapKV, quantize, select
    from kvedit.memory.answering import decode
    from kvedit.memory.rendering import Message
    from kvedit.states.capturing import extend_ids

    state = memory.state
    messages = list(memory.messages)
    renderer = memory.renderer
    for k, probe in enumerate(conversation.probes):
        t0 = time.perf_counter()
        if k == 0 and budget < 1:
            state = select(state, SnapKV(query=probe.question), budget)
        if k == 0 and bits is not None:
            state = quantize(state, bits, residual=0)
        held = _holding(memory.model, state)
        asked = [*messages, Message("user", probe.question)]
        p = renderer.render(asked, generation_prompt=True)
        n = len(state)
        prompt = extend_ids(state, p.ids[n:], p.offsets[n:], p.text)
        text = decode(prompt, max_new_tokens, renderer.stops).text.strip()
        if conversation.remember:
            messages = [*asked, Message("assistant", text or " ")]
            full = renderer.render(messages)
            state = extend_ids(state, full.ids[n:], full.offsets[n:], full.text)
        yield text, time.perf_counter() - t0, held


def _reread(memory, question: str, max_new_tokens: int) -> tuple[str, float]:
    """The answer to ``question`` from a capture of the whole transcript made now, and its
    seconds (re-reading the transcript every turn)."""
    from kvedit.memory.answering import decode
    from kvedit.memory.rendering import Message
    from kvedit.states.capturing import empty_state, extend_ids

    t0 = time.perf_counter()
    asked = [*memory.messages, Message("user", question)]
    p = memory.renderer.render(asked, generation_prompt=True)
    state = extend_ids(empty_state(memory.model, memory.tokenizer), p.ids, p.offsets, p.text)
    text = decode(state, max_new_tokens, memory.renderer.stops).text.strip()
    return text, time.perf_counter() - t0


def _ages(renderer, conversation: Conversation) -> list[int | None]:
    """Each question's age in tokens: the rendering's tokens after the message of its oldest
    evidence turn (None for a question without evidence, and for every generated task's)."""
    if not any(p.evidence for p in conversation.probes):
        return [None] * len(conversation.probes)
    ends = message_ends(renderer, conversation.messages)
    return [None if not p.evidence else ends[-1] - ends[p.where + 1] for p in conversation.probes]


def _record(
    conversation: Conversation,
    k: int,
    method: MemoryMethod,
    budget: float,
    memory,
    prediction: str,
    seconds: float,
    held: dict,
    context: dict,
) -> dict:
    """The record of question ``k`` (the fields: :mod:`kvedit.evals.memory`'s docstring);
    ``held``: what the memory held when it was asked; ``context``: the conversation's
    ``digest``, ``ages``, ``max_entries``, ``full_entries`` and ``build_seconds``."""
    probe = conversation.probes[k]
    rounds = memory.forgetting
    return {
        "id": f"{conversation.id}-q{k}",
        "example": conversation.id,
        "digest": context["digest"],
        "method": method.spec,
        "budget": budget,
        "bucket": probe.bucket,
        "where": probe.where,
        "question": probe.question,
        "answers": list(probe.answers),
        "prediction": prediction,
        "correct": best_subspan_em(prediction, probe.answers),
        "em": exact_match(prediction, probe.answers),
        "f1": round(token_f1(prediction, probe.answers), 4),
        "category": probe.category,
        "evidence": list(probe.evidence),
        "age_turns": probe.age_turns,
        "age_tokens": context["ages"][k],
        "seconds": round(seconds, 4),
        "max_entries": context["max_entries"],
        "max_bytes": None if memory.budget is None else memory.budget.max_bytes,
        **held,
        "full_entries": context["full_entries"],
        "rounds": len(rounds),
        "forget_seconds": round(math.fsum(r.seconds for r in rounds), 4),
        "build_seconds": context["build_seconds"],
    }


def run_conversation(
    model,
    tokenizer,
    conversation: Conversation,
    method: MemoryMethod,
    budget: float,
    *,
    task: str,
    max_new_tokens: int = 16,
    reread: list[dict] | None = None,
) -> list[dict]:
    """One method at one budget on one conversation: a record per question (module
    docstring). With ``reread`` (a list), the first :data:`REREAD_TURNS` questions are also
    answered by re-reading the transcript, timed, each appended to it as
    ``{"seconds", "reuse_seconds", "same_answer"}``."""
    renderer = default_renderer(tokenizer)
    full = full_entries(renderer, conversation)
    max_tokens = budget_entries(budget, full)
    memory = _memory(model, tokenizer, method, budget, full)
    t0 = time.perf_counter()
    for role, content in conversation.messages:
        memory.add(role, content)
    build = time.perf_counter() - t0

    context = {
        "digest": conversation.digest(),
        "ages": _ages(renderer, conversation),
        "max_entries": None if method.params.in_bytes else max_tokens,
        "full_entries": full,
        "build_seconds": round(build, 4),
    }

    def record(k: int, prediction: str, seconds: float, held: dict) -> dict:
        return _record(conversation, k, method, budget, memory, prediction, seconds, held, context)

    records = []
    if method.name == "snapkv-first":
        bits = method.params.quantize
        answers = _snapkv_first_answers(memory, conversation, budget, max_new_tokens, bits)
        for k, (text, seconds, held) in enumerate(answers):
            records.append(record(k, text, seconds, held))
        return records
    for k, probe in enumerate(conversation.probes):
        timed = reread is not None and k < REREAD_TURNS
        again = _reread(memory, probe.question, max_new_tokens) if timed else None
        held = _holding(model, memory.state)
        t = time.perf_counter()
        text = memory.ask(probe.question, max_new_tokens, remember=conversation.remember)
        records.append(record(k, text, time.perf_counter() - t, held))
        if again is not None:
            reread.append(
                {
                    "seconds": round(again[1], 4),
                    "reuse_seconds": records[-1]["seconds"],
                    "same_answer": again[0] == text,
                }
            )
    return records
