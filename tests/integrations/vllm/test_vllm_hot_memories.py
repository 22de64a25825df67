"""Hot memories stay in RAM (:mod:`kvedit.integrations.vllm.memories`), without vLLM:

* a turn's memory and its stock file are read and checked once, when first met; a server
  serving its own conversation reads neither again (``MemoryFiles.reads`` counts reads);
* a file changed on disk (a copy over it, a damaged byte) is read and checked again, so the
  refusals still fire in a server that holds the file's old version in RAM;
* the RAM kept is bounded (least recently used first);
* kvedit serve writes a turn's memory once its response has ended (or when the next request
  comes first, which is then served from it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace

import pytest
from test_vllm_conversations import (
    ANSWERS,
    SYSTEM,
    USERS,
    converse,
    emulate_vllm,
    memory_file,
    next_messages,
)

from kvedit.errors import KVEditError
from kvedit.integrations.vllm.chat import TURN_SCOPE_KEY, ChatMemories
from kvedit.integrations.vllm.conversations import MEMORIES, Conversations
from kvedit.integrations.vllm.memories import HOT_BYTES


def test_a_served_conversation_reads_and_verifies_each_file_once(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    assert conv.memories.hot_bytes == HOT_BYTES == 256 << 20
    done = converse(conv, model, tok, n=3)
    assert done[2][0].digest == done[1][1]["memory_digest"]  # served from its memory
    assert sum(conv.memories.reads.values()) == 0  # what it stored it knows: no read
    # another server on the root reads the latest memory and its stock file once ...
    fresh = Conversations(tmp_path, model, tok, forget="window")
    messages = [*next_messages(2), {"role": "assistant", "content": ANSWERS[2]}]
    plan = fresh.plan([*messages, {"role": "user", "content": "And Carol's?"}])
    assert plan.digest == done[2][1]["memory_digest"]
    assert fresh.memories.reads == {"memory": 1, "stock": 1}
    emulate_vllm(fresh, plan, "5902", model, tok)
    said = fresh.commit(plan, "5902")
    messages += [
        {"role": "user", "content": "And Carol's?"},
        {"role": "assistant", "content": "5902"},
    ]
    again = fresh.plan([*messages, {"role": "user", "content": "Thanks."}])
    assert again.digest == said["memory_digest"]
    assert fresh.memories.reads == {"memory": 1, "stock": 1}  # ... and no file after


def test_a_file_changed_on_disk_is_read_and_checked_again(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    first, second = converse(conv, model, tok, n=2)
    a = memory_file(tmp_path, first[1]["memory_digest"])
    b = memory_file(tmp_path, second[1]["memory_digest"])
    kept = b.read_bytes()
    shutil.copyfile(a, b)  # in RAM in this server, copied over on disk
    n_a, n_b = (int(p.name.split("-")[0]) for p in (a, b))
    with pytest.raises(KVEditError, match=f"holds {n_a} token ids, its name says {n_b}"):
        conv.memories.load(b)
    assert conv.memories.reads["memory"] == 1
    b.write_bytes(kept)
    data = bytearray(kept)
    data[-5] ^= 0xFF  # a bad seal, same size
    b.write_bytes(bytes(data))
    plan = conv.plan(next_messages(2))  # the damaged latest passed over, its parent serves
    assert plan.digest == first[1]["memory_digest"]
    assert plan.fallback["from"] == second[1]["memory_digest"]
    assert conv.memories.reads["memory"] == 2


def test_the_memories_kept_in_ram_are_bounded_least_recently_used_first(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    first, second = converse(conv, model, tok, n=2)
    assert conv.memories.hot() == [first[1]["memory_digest"], second[1]["memory_digest"]]
    small = Conversations(tmp_path, model, tok, forget="window")
    small.memories.hot_bytes = second[1]["memory_bytes"]  # room for one memory
    a = memory_file(tmp_path, first[1]["memory_digest"])
    b = memory_file(tmp_path, second[1]["memory_digest"])
    small.memories.load(a)
    small.memories.load(b)  # the first goes
    assert small.memories.hot() == [second[1]["memory_digest"]]
    small.memories.load(a)  # read again
    assert small.memories.reads["memory"] == 3
    assert small.memories.hot() == [first[1]["memory_digest"]]


def test_a_deferred_memory_is_written_after_the_response_or_by_the_next_request(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window", defer_writes=True)
    messages = [SYSTEM, {"role": "user", "content": USERS[0]}]
    plan = conv.plan(messages)
    emulate_vllm(conv, plan, ANSWERS[0], model, tok)
    said = conv.commit(plan, ANSWERS[0])
    assert not list((tmp_path / MEMORIES).iterdir())  # made, not yet written
    conv.drop_turn(plan.turn)  # the response has ended
    assert memory_file(tmp_path, said["memory_digest"]).is_file()
    messages += [{"role": "assistant", "content": ANSWERS[0]}]
    messages += [{"role": "user", "content": USERS[1]}]
    plan = conv.plan(messages)
    emulate_vllm(conv, plan, ANSWERS[1], model, tok)
    said = conv.commit(plan, ANSWERS[1])
    # the next request comes before the turn is dropped: it writes the memory and is served
    messages += [{"role": "assistant", "content": ANSWERS[1]}]
    after = conv.plan([*messages, {"role": "user", "content": USERS[2]}])
    assert after.digest == said["memory_digest"]
    assert sum(conv.memories.reads.values()) == 0
    conv.drop_turn(plan.turn)  # nothing left to write


def test_kvedit_serves_chat_memory_is_written_once_the_response_has_ended(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window", defer_writes=True)
    messages = [SYSTEM, {"role": "user", "content": USERS[0]}]

    async def vllm(scope, receive, send):  # computes the turn as vLLM's worker saves it
        request = json.loads((await receive())["body"])
        plan = conv.plan(messages)
        plan = replace(plan, turn=scope[TURN_SCOPE_KEY])
        assert request["kv_transfer_params"]["kvedit"]["turn"] == plan.turn
        emulate_vllm(conv, plan, ANSWERS[0], model, tok)
        body = {"choices": [{"message": {"content": ANSWERS[0]}, "finish_reason": "stop"}]}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    written_at_end: list[bool] = []
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            written_at_end.append(any((tmp_path / MEMORIES).iterdir()))

    async def receive():
        raw = json.dumps({"model": "m", "messages": messages}).encode()
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(ChatMemories(vllm, conv)(scope, receive, send))
    said = json.loads(sent[-1]["body"])["kv_transfer_params"]["kvedit"]
    assert "error" not in said and said["memory_digest"]
    assert written_at_end == [False]  # the response ended before the files were written
    assert memory_file(tmp_path, said["memory_digest"]).is_file()  # and then they were
