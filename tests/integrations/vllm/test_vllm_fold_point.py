"""A served memory forgets where an in-process :class:`kvedit.Memory` forgets, without vLLM
(:mod:`kvedit.integrations.vllm.conversations`): a turn's K/V are computed here the way vLLM
computes them (the engine prompt, then the answer less its last sampled token, keys rotated at
the engine's positions) and written as the worker writes them.

* Under a byte budget, turn by turn, the served memory holds the same tokens as an in-process
  memory with the same budget that asked the same questions (the answer's closing tokens
  included, computed at the commit), and on every layer the same entries.
* Every system message's turn is protected as a Memory protects it (the one fold,
  :func:`kvedit.memory.folding.fold_turn`): a system message after the first keeps its markup.
"""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit import rope
from kvedit.errors import KVEditError
from kvedit.integrations.vllm import committing, turns
from kvedit.integrations.vllm.conversations import MEMORIES, Conversations
from kvedit.memory.rendering import Message
from kvedit.states.capturing import empty_state, extend_ids
from kvedit.states.files.read import read_attached

SYSTEM = "You keep notes for the user."
USERS = [
    "Alice's code is 4821 and Bob's is 7310. Please remember both.",
    "Carol's code is 5902. What is Alice's code?",
    "And what is Bob's code? Answer with the number only.",
]


def emulate_vllm(conv, plan, answer: str, cut: bool, model, tok) -> None:
    """Write what vLLM's worker writes for ``plan`` answered ``answer``: the engine prompt's
    new tokens and the answer's, less its last sampled token (the end of turn; the last
    answer token when ``cut`` at max_tokens), keys rotated at the engine's positions."""
    full = conv.renderer.render([*plan.messages, Message("assistant", answer)])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    answer_ids = full.ids[len(plan.rendering.ids) :]
    answer_ids = answer_ids[: answer_ids.index(eos)] if eos in answer_ids else answer_ids
    new = [*plan.rendering.ids[plan.held :], *(answer_ids[:-1] if cut else answer_ids)]
    memory = (
        empty_state(model, tok)
        if plan.memory is None
        else read_attached(plan.memory, model, tok).state
    )
    state = extend_ids(memory, new, torch.zeros(len(new), 2, dtype=torch.long), full.text)
    shift = len(plan.slots) - int(memory.next_position)  # the memory's positions -> vLLM's
    movers = rope.movers(model)
    keys, values = [], []
    for i, layer in enumerate(state.layers):
        k, v = layer.keys[:, :, -len(new) :], layer.values[:, :, -len(new) :]
        if shift:
            k = movers[i].move(k, torch.full((len(new),), shift, dtype=torch.long))
        keys.append(k[0].transpose(0, 1).contiguous())
        values.append(v[0].transpose(0, 1).contiguous())
    turns.write_turn(conv.root, plan.turn, len(plan.slots), new, keys, values)


def served_memory(root, said, model, tok):
    (path,) = (root / MEMORIES).glob(f"*-{said['memory_digest']}.safetensors")
    return read_attached(path, model, tok).state


def test_under_a_budget_served_and_in_process_memories_hold_the_same_entries(llama, tmp_path):
    model, tok = llama
    budget = 64 * kvedit.capture_tokens(model, tok, [1]).nbytes
    # what the server's memories do: the same tokens on every layer, compact positions
    mem = kvedit.Memory(
        model, tok, system=SYSTEM, max_bytes=budget, forget="knorm", keep="token",
        reposition="always",
    )  # fmt: skip
    conv = Conversations(tmp_path, model, tok, forget="knorm")
    messages = [{"role": "system", "content": SYSTEM}]
    for user in USERS:
        answer = mem.ask(user, max_new_tokens=6)
        messages.append({"role": "user", "content": user})
        plan = conv.plan(messages, {"kvedit": {"max_bytes": budget}})
        assert plan.budget == mem.budget
        emulate_vllm(conv, plan, answer, mem.last_answer.ended == "length", model, tok)
        said = conv.commit(plan, answer)
        served = served_memory(tmp_path, said, model, tok)
        # the whole conversation, the answer's closing tokens included: the same point
        assert served.token_ids.tolist() == mem.state.token_ids.tolist()
        for a, b in zip(served.layers, mem.state.layers, strict=True):
            assert a.token_index.tolist() == b.token_index.tolist()
            assert torch.allclose(a.values, b.values, atol=1e-4)
        messages.append({"role": "assistant", "content": answer})
    assert mem.forgetting, "the budget never forgot: the test checks nothing"


def test_a_later_system_message_keeps_its_whole_turn(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    budget = 96 * kvedit.capture_tokens(model, tok, [1]).nbytes
    later = "From now on, answer in French."
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USERS[0]},
        {"role": "assistant", "content": "I will remember them."},
        {"role": "system", "content": later},
        {"role": "user", "content": " ".join(USERS)},
    ]
    plan = conv.plan(messages, {"kvedit": {"max_bytes": budget}})
    emulate_vllm(conv, plan, "Yes.", False, model, tok)
    said = conv.commit(plan, "Yes.")
    assert said["forgot"] > 0
    parsed = [Message(m["role"], m["content"]) for m in messages]
    start = len(conv.renderer.render(parsed[:3]).ids)  # as kvedit.Memory records its turn
    end = len(conv.renderer.render(parsed[:4]).ids)
    served = served_memory(tmp_path, said, model, tok)
    for layer in served.layers:
        held = set(layer.token_index.tolist())
        assert set(range(start, end)) <= held, "the later system message's markup was forgotten"


def test_closing_a_turn_refuses_a_rendering_the_memory_is_not_a_prefix_of(llama):
    """Nothing is appended after the wrong tokens: a memory whose tokens are not where the
    conversation rendered with the answer starts is refused, not extended."""
    model, tok = llama
    mem = kvedit.Memory(model, tok, system=SYSTEM)
    mem.add("user", USERS[0])
    other = kvedit.Memory(model, tok, system=SYSTEM)
    other.add("user", USERS[1])
    full = other.renderer.render([*other.messages, Message("assistant", "Yes.")])
    with pytest.raises(KVEditError, match="not a prefix"):
        committing.closed(mem.state, full)
    same = mem.renderer.render([*mem.messages, Message("assistant", "Yes.")])
    assert len(committing.closed(mem.state, same)) == len(same.ids)
