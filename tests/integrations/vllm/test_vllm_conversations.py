"""Chat conversations served from their memories, without vLLM
(:mod:`kvedit.integrations.vllm.conversations`): a turn is planned, its K/V are computed here the
way vLLM computes them (keys rotated at the engine's positions: the memory's slots first) and
written as the worker writes them, and the commit makes the next memory.

* Without a budget each memory holds exactly the conversation's tokens, and its entries are a
  capture of them; the next request is served from it (its slots, then only the new tokens).
* Under a byte budget the memory never holds more, forgets, and keys computed at vLLM's
  positions are moved back to the memory's.
* What cannot be served is refused before any work.
"""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit import rope
from kvedit.errors import InvalidInputError, KVEditError
from kvedit.integrations.vllm import files, turns
from kvedit.integrations.vllm.conversations import MAX_CONVERSATION_CHARS, MEMORIES, Conversations
from kvedit.memory.rendering import Message
from kvedit.states.capturing import empty_state, extend_ids
from kvedit.states.files.read import read_attached

SYSTEM = {"role": "system", "content": "You keep notes for the user."}
USERS = [
    "Alice's code is 4821 and Bob's is 7310. Please remember both.",
    "Carol's code is 5902. What is Alice's code?",
    "And what is Bob's code? Answer with the number only.",
]
ANSWERS = ["I will remember them.", "Alice's code is 4821.", "7310"]


def emulate_vllm(conv: Conversations, plan, answer: str, model, tok) -> None:
    """Compute the turn as vLLM does and write what its worker writes: the engine prompt
    (the memory's slots, then the new tokens) and the answer, less its last sampled token (the
    end of turn), keys rotated at the engine's positions."""
    full = conv.renderer.render([*plan.messages, Message("assistant", answer)])
    n_prompt = len(plan.rendering.ids)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    answer_ids = full.ids[n_prompt:]
    answer_ids = answer_ids[: answer_ids.index(eos)] if eos in answer_ids else answer_ids
    new = [*plan.rendering.ids[plan.held :], *answer_ids]
    if plan.memory is None:
        memory = empty_state(model, tok)
    else:
        memory = read_attached(plan.memory, model, tok).state
    text = full.text
    offsets = torch.zeros(len(new), 2, dtype=torch.long)
    state = extend_ids(memory, new, offsets, text)
    shift = len(plan.slots) - int(memory.next_position)  # the memory's positions -> vLLM's
    keys, values = [], []
    movers = rope.movers(model)
    for i, layer in enumerate(state.layers):
        k, v = layer.keys[:, :, -len(new) :], layer.values[:, :, -len(new) :]
        if shift:
            k = movers[i].move(k, torch.full((len(new),), shift, dtype=torch.long))
        keys.append(k[0].transpose(0, 1).contiguous())
        values.append(v[0].transpose(0, 1).contiguous())
    turns.write_turn(conv.root, plan.turn, len(plan.slots), new, keys, values)
    return state


def next_messages(n):
    """The system message, ``n`` user/assistant exchanges, then user message ``n``."""
    messages = [SYSTEM]
    for user, answer in zip(USERS[:n], ANSWERS[:n], strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": USERS[n]}]


def memory_file(root, digest):
    """The one memory file under ``root`` whose name ends in ``digest``."""
    (path,) = (root / MEMORIES).glob(f"*-{digest}.safetensors")
    return path


def converse(conv, model, tok, n=3, params=None):
    """Serve ``n`` turns; yields ``(plan, said, emulated state)`` per turn."""
    messages = [SYSTEM]
    out = []
    for user, answer in list(zip(USERS, ANSWERS, strict=True))[:n]:
        messages.append({"role": "user", "content": user})
        plan = conv.plan(messages, params)
        state = emulate_vllm(conv, plan, answer, model, tok)
        out.append((plan, conv.commit(plan, answer), state))
        messages.append({"role": "assistant", "content": answer})
    return out


def test_without_a_budget_each_turn_is_served_from_the_last_memory_and_holds_a_capture(
    llama, tmp_path
):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    done = converse(conv, model, tok)
    assert done[0][0].memory is None and done[0][1]["forgot"] == 0
    for (plan, _, _), (_, said_before, _) in zip(done[1:], done[:-1], strict=True):
        assert plan.digest == said_before["memory_digest"]
        assert plan.slots == plan.rendering.ids[: plan.held]  # nothing forgotten: the same ids
        assert plan.prompt_token_ids == plan.rendering.ids
        assert plan.kv_transfer_params["kvedit"] == {"digest": plan.digest, "turn": plan.turn}
    digest = done[-1][1]["memory_digest"]
    (path,) = (tmp_path / MEMORIES).glob(f"*-{digest}.safetensors")
    memory = read_attached(path, model, tok).state
    capture = kvedit.capture_tokens(model, tok, memory.token_ids.tolist())
    for a, b in zip(memory.layers, capture.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index)
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(
            a.values, b.values, atol=1e-4
        )
    assert any(s.kind == "computed" for s in memory.history.steps)  # no capture claimed
    assert not memory.is_plain_capture
    assert files.PublishedIndex(tmp_path).with_digest(digest)  # its stock form, for vLLM
    assert not list((tmp_path / turns.TURNS).iterdir())  # the turns' files are gone
    kept = {p.name.split("-")[-1].split(".")[0] for p in (tmp_path / MEMORIES).iterdir()}
    assert kept == {said["memory_digest"] for _, said, _ in done[-2:]}  # the last two
    assert not files.PublishedIndex(tmp_path).with_digest(done[0][1]["memory_digest"])


@pytest.mark.parametrize("policy", ["learned", "knorm"])
def test_under_a_byte_budget_a_memory_never_holds_more_and_keys_move_back(
    llama, tmp_path, policy, learned_fit
):
    model, tok = llama
    learned_fit(model, tok)  # learned ranks all layers together: they would keep unequal counts
    conv = Conversations(tmp_path, model, tok, forget=policy)
    per_token = kvedit.capture_tokens(model, tok, [1]).nbytes
    budget = 64 * per_token
    done = converse(conv, model, tok, params={"kvedit": {"max_bytes": budget}})
    assert all(said["memory_bytes"] <= budget for _, said, _ in done)
    assert sum(said["forgot"] for _, said, _ in done) > 0
    for _, said, _ in done[-2:]:  # every layer keeps the same tokens: exact, no null slot
        (stock,) = files.PublishedIndex(tmp_path).with_digest(said["memory_digest"])
        header = files.read_header(stock[0])
        assert header["exact"] and not any(header["null_entries"])
    plan, said, emulated = done[-1]
    assert len(plan.slots) < plan.held  # served from a memory that forgot: keys were moved
    (path,) = (tmp_path / MEMORIES).glob(f"*-{said['memory_digest']}.safetensors")
    memory = read_attached(path, model, tok).state
    movers = rope.movers(model)
    for i, (a, b) in enumerate(zip(memory.layers, emulated.layers, strict=True)):
        where = {int(t): j for j, t in enumerate(b.token_index.tolist())}
        new = [
            (j, where[int(t)])
            for j, t in enumerate(a.token_index.tolist())
            if plan.held <= t < len(emulated)
        ]
        assert new, "the last turn kept none of its tokens"
        ja, jb = torch.tensor([x for x, _ in new]), torch.tensor([y for _, y in new])
        # the memory's positions are compact (kvedit.memory.repositioning): moved to the
        # emulated memory's positions, its keys are the ones vLLM computed
        assert bool((a.positions[ja] <= b.positions[jb]).all())
        back = movers[i].move(a.keys[:, :, ja], b.positions[jb] - a.positions[ja])
        assert torch.allclose(back, b.keys[:, :, jb], atol=1e-4)


def test_what_cannot_be_served_is_refused_before_any_work(llama, tmp_path):
    model, tok = llama
    with pytest.raises(InvalidInputError, match="cannot serve"):
        Conversations(tmp_path, model, tok, forget="kvzip")
    conv = Conversations(tmp_path, model, tok, forget="window")
    messages = [SYSTEM, {"role": "user", "content": USERS[0]}]
    for params, match in (
        ({"kvedit": {"turns": 3}}, "takes"),
        ({"kvedit": {"max_bytes": 0}}, "positive"),
        ({"kvedit": {"max_bytes": "8MiB"}}, "positive"),
        ({"kvedit": {"digest": "0" * 32}}, "no memory with digest"),
        ({"kvedit": {"digest": "forged"}}, "32 lowercase hex"),
    ):
        with pytest.raises(KVEditError, match=match):
            conv.plan(messages, params)
    huge = {"role": "user", "content": "x" * (MAX_CONVERSATION_CHARS + 1)}
    with pytest.raises(InvalidInputError, match="at most"):
        conv.plan([SYSTEM, huge])
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(InvalidInputError, match="text only"):
        conv.plan([SYSTEM, image])
    plan = conv.plan(messages)
    turns.write_turn_error(tmp_path, plan.turn, "the layout could not be read")
    with pytest.raises(KVEditError, match="layout"):
        conv.commit(plan, "ok")
    assert not list((tmp_path / MEMORIES).iterdir())  # nothing stored
