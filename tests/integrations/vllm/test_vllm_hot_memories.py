"""Hot memories stay in RAM (:mod:`kvedit.integrations.vllm.memories`), without vLLM:

* a turn's memory and its stock file are read and checked once, when first met; a server
  serving its own conversation reads neither again (``MemoryFiles.reads`` counts reads);
* a file changed on disk (a copy over it, a damaged byte) is read and checked again, so the
  refusals still fire in a server that holds the file's old version in RAM;
* the RAM kept is bounded (least recently used first).
"""

from __future__ import annotations

import shutil

import pytest
from test_vllm_conversations import ANSWERS, SYSTEM, USERS, converse, emulate_vllm

from kvedit.errors import KVEditError
from kvedit.integrations.vllm.conversations import MEMORIES, Conversations
from kvedit.integrations.vllm.memories import HOT_BYTES


def _next_messages(n):
    messages = [SYSTEM]
    for user, answer in zip(USERS[:n], ANSWERS[:n], strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": USERS[n]}]


def _memory(root, digest):
    (path,) = (root / MEMORIES).glob(f"*-{digest}.safetensors")
    return path


def test_a_served_conversation_reads_and_verifies_each_file_once(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    assert conv.memories.hot_bytes == HOT_BYTES == 256 << 20
    done = converse(conv, model, tok, n=3)
    assert done[2][0].digest == done[1][1]["memory_digest"]  # served from its memory
    assert sum(conv.memories.reads.values()) == 0  # what it stored it knows: no read
    # another server on the root reads the latest memory and its stock file once ...
    fresh = Conversations(tmp_path, model, tok, forget="window")
    messages = [*_next_messages(2), {"role": "assistant", "content": ANSWERS[2]}]
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
    a = _memory(tmp_path, first[1]["memory_digest"])
    b = _memory(tmp_path, second[1]["memory_digest"])
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
    plan = conv.plan(_next_messages(2))  # the damaged latest passed over, its parent serves
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
    a = _memory(tmp_path, first[1]["memory_digest"])
    b = _memory(tmp_path, second[1]["memory_digest"])
    small.memories.load(a)
    small.memories.load(b)  # the first goes
    assert small.memories.hot() == [second[1]["memory_digest"]]
    small.memories.load(a)  # read again
    assert small.memories.reads["memory"] == 3
    assert small.memories.hot() == [first[1]["memory_digest"]]
