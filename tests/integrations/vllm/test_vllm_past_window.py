"""A served conversation under a budget goes on past the model's positions
(:mod:`kvedit.integrations.vllm.conversations`, without vLLM): every memory it stores holds
compact positions, so no request vLLM accepts after its slots reaches past them."""

from __future__ import annotations

import pytest
from test_vllm_conversations import SYSTEM, emulate_vllm, memory_file

import kvedit
from kvedit.integrations.vllm.conversations import Conversations
from kvedit.memory.repositioning import compact_end, is_compact
from kvedit.states.files.read import read_attached


@pytest.fixture
def short_positions(llama, monkeypatch):
    """The tiny Llama, its config saying it attends to 160 positions."""
    model, tok = llama
    monkeypatch.setattr(model.config.get_text_config(), "max_position_embeddings", 160)
    return model, tok, 160


def test_a_served_conversation_under_a_budget_passes_the_models_positions(
    short_positions, tmp_path
):
    model, tok, limit = short_positions
    conv = Conversations(tmp_path, model, tok, forget="knorm")
    per_token = kvedit.capture_tokens(model, tok, [1]).nbytes
    params = {"kvedit": {"max_bytes": 96 * per_token}}
    messages = [SYSTEM]
    read = 0
    for turn in range(12):
        messages.append(
            {"role": "user", "content": f"Note {turn}: the shed key is under pot {turn}."}
        )
        plan = conv.plan(messages, params)
        answer = f"Noted, pot {turn}."
        emulate_vllm(conv, plan, answer, model, tok)
        said = conv.commit(plan, answer)
        messages.append({"role": "assistant", "content": answer})
        memory = read_attached(memory_file(tmp_path, said["memory_digest"]), model, tok).state
        assert is_compact(memory)
        assert memory.next_position == compact_end(memory) < limit
        read = len(plan.rendering.ids)
    assert read > 2 * limit  # the conversation went far past the positions
    steps = [s for s in memory.history.steps if s.kind == "reposition"]
    assert steps and not steps[-1].exact
