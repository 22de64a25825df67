"""The served memories' files, without vLLM (:mod:`kvedit.integrations.vllm.memories`):

* a leftover in ``ROOT/turns`` or ``ROOT/memories`` (a killed writer's folder, any entry) is
  swept and never stops a chat request;
* a memory file whose ids are not its name's (copied over another) is refused by name;
* a conversation whose latest memory is damaged is served from its parent, and says so;
* messages and folders the server cannot use are refused with kvedit's message.
"""

from __future__ import annotations

import os
import shutil
import time

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

from kvedit.atomic import STALE_TEMP_SECONDS, temp_name
from kvedit.errors import InvalidInputError, KVEditError, StorageError
from kvedit.integrations.vllm import files, turns
from kvedit.integrations.vllm.conversations import MEMORIES, Conversations


def _aged(path, seconds):
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_leftover_folders_are_swept_and_never_stop_a_chat_request(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    folder = tmp_path / turns.TURNS
    folder.mkdir()
    left = temp_name(folder / ("a" * 32 + ".safetensors"))  # a killed worker's write
    left.mkdir()
    (left / "part").write_bytes(b"x")
    (folder / "odd").mkdir()
    (folder / "odd" / "f").write_bytes(b"y")
    (folder / "f.txt").write_bytes(b"z")
    for p in (left, folder / "odd", folder / "f.txt"):
        _aged(p, turns.STALE_TURN_SECONDS + 5)
    stale = temp_name(tmp_path / MEMORIES / "3-x-y.safetensors").with_name(
        ".3-x-y.safetensors.kvedit-tmp-1@00000000-0123456789abcdef"  # another machine's
    )
    stale.mkdir()
    (stale / "part").write_bytes(b"x")
    _aged(stale, STALE_TEMP_SECONDS + 5)
    done = converse(conv, model, tok, n=2)  # planned, served and kept as before
    assert done[1][0].digest == done[0][1]["memory_digest"]
    assert not os.path.lexists(left) and not os.path.lexists(stale)
    assert not list(folder.iterdir())
    assert turns.sweep_turns(tmp_path) == 0  # nothing left, nothing raised


def test_a_memory_copied_over_another_is_refused_by_name(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    first, second = converse(conv, model, tok, n=2)
    a, b = (
        memory_file(tmp_path, first[1]["memory_digest"]),
        memory_file(tmp_path, second[1]["memory_digest"]),
    )
    # another server (a fresh process: nothing in RAM) reads the files
    fresh = Conversations(tmp_path, model, tok, forget="window")
    shutil.copyfile(a, b)  # a shorter memory over the latest: the lengths differ
    n_a, n_b = (int(p.name.split("-")[0]) for p in (a, b))
    with pytest.raises(
        KVEditError, match=f"{b.name}: the memory file holds {n_a} token ids, its name says {n_b}"
    ):
        fresh.memories.load(b)
    with pytest.raises(KVEditError, match="holds"):  # nor served: the parent serves instead
        fresh.memories.find(
            list(fresh.plan(next_messages(2)).rendering.ids), second[1]["memory_digest"]
        )
    # same length, other ids: a memory file renamed to another conversation's name
    forged = b.with_name(f"{n_a}-{'0' * 32}-{first[1]['memory_digest']}.safetensors")
    shutil.copyfile(a, forged)
    fresh = Conversations(tmp_path, model, tok, forget="window")
    with pytest.raises(KVEditError, match=f"{forged.name}.*not the ones its name addresses"):
        fresh.memories.load(forged)
    # same ids, another digest: a memory of the same messages that another server made
    other = a.with_name(f"{n_a}-{a.name.split('-')[1]}-{'1' * 32}.safetensors")
    shutil.copyfile(a, other)
    with pytest.raises(KVEditError, match=f"{other.name}.*digest"):
        fresh.memories.load(other)


def test_a_damaged_latest_memory_is_passed_over_for_its_parent_and_said(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    first, second = converse(conv, model, tok, n=2)
    latest = memory_file(tmp_path, second[1]["memory_digest"])
    data = bytearray(latest.read_bytes())
    data[-5] ^= 0xFF  # a bad seal
    latest.write_bytes(bytes(data))
    fresh = Conversations(tmp_path, model, tok, forget="window")
    plan = fresh.plan(next_messages(2))
    assert plan.digest == first[1]["memory_digest"]  # the parent serves
    assert plan.fallback["from"] == second[1]["memory_digest"] and plan.fallback["why"]
    emulate_vllm(fresh, plan, ANSWERS[2], model, tok)
    said = fresh.commit(plan, ANSWERS[2])
    assert said["memory_digest"]
    # the stock file missing: the same
    fresh = Conversations(tmp_path, model, tok, forget="window")
    (stock,) = files.PublishedIndex(tmp_path).with_digest(said["memory_digest"])
    stock[0].unlink()
    messages = [*next_messages(2), {"role": "assistant", "content": ANSWERS[2]}]
    plan = fresh.plan([*messages, {"role": "user", "content": "And Carol's?"}])
    assert plan.fallback["from"] == said["memory_digest"]
    assert "no published stock file" in plan.fallback["why"]
    with pytest.raises(KVEditError, match="no published stock file"):  # named: refused
        fresh.plan(
            messages + [{"role": "user", "content": "?"}],
            {"kvedit": {"digest": said["memory_digest"]}},
        )


def test_messages_and_folders_the_server_cannot_use_are_refused_clearly(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    with pytest.raises(InvalidInputError, match="lone surrogate"):
        conv.plan([{"role": "user", "content": "hi \ud800 there"}])
    with pytest.raises(InvalidInputError, match="at least one message"):
        conv.plan([])
    with pytest.raises(KVEditError, match="serve"):
        Conversations(tmp_path, model, tok, forget="")
    memories = tmp_path / MEMORIES
    shutil.rmtree(memories)  # removed: made again
    assert conv.plan([SYSTEM, {"role": "user", "content": USERS[0]}]).memory is None
    assert memories.is_dir()
    shutil.rmtree(memories)
    memories.write_text("not a folder")
    with pytest.raises(StorageError, match="is not a folder"):
        conv.plan([SYSTEM, {"role": "user", "content": USERS[0]}])
    memories.unlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    memories.symlink_to(empty)  # a link to an empty folder: a new conversation
    assert conv.plan([SYSTEM, {"role": "user", "content": USERS[0]}]).memory is None
