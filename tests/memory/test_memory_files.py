"""A memory file cannot be corrupted, shared or misread without a word: an altered memory is
never saved or stored, a save over another writer's file is refused, and every field of a
file's memory attachment is checked at load (a file resealed without this installation's key
can claim nothing its rendering does not show)."""

from __future__ import annotations

import pytest
from helpers import edit_file_header, set_at

import kvedit
from kvedit.errors import CorruptCacheError, FileChangedError, StateAlteredError
from kvedit.states.files.read import read_state_file
from kvedit.states.files.seal import make_seal, tensors_digest

CHAT = [
    ("user", "My locker code is 4821."),
    ("assistant", "Noted."),
    ("user", "My badge number is 77."),
    ("assistant", "Got it: 77."),
]


def _state_of(mem):
    return (mem.state.digest, mem.messages, mem.turns, mem.forgetting)


@pytest.fixture()
def memory(llama):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=400, forget="window")
    for role, content in CHAT:
        mem.add(role, content)
    return mem


def test_an_altered_memory_is_neither_saved_nor_stored(memory, tmp_path):
    before = _state_of(memory)
    memory.state.layers[1].values.mul_(-1)
    with pytest.raises(StateAlteredError, match="saving the memory"):
        memory.save(tmp_path / "m.kv")
    assert not (tmp_path / "m.kv").exists()
    with pytest.raises(StateAlteredError):
        kvedit.KVStore(tmp_path / "store").put(memory.state)
    assert _state_of(memory) == before


def test_a_save_over_a_file_another_writer_changed_is_refused(memory, tmp_path):
    model, tok = memory.model, memory.tokenizer
    path = memory.save(tmp_path / "m.kv")
    memory.save(path)  # its own file, as it wrote it: saved again
    a = kvedit.Memory.load(path, model, tok)
    b = kvedit.Memory.load(path, model, tok)
    a.add("user", "Chat A speaks.")
    a.save(path)
    b.add("user", "Chat B speaks.")
    before = _state_of(b)
    with pytest.raises(FileChangedError, match="m.kv changed since.*another writer"):
        b.save(path)
    assert _state_of(b) == before
    assert kvedit.Memory.load(path, model, tok).messages == a.messages  # A's, untouched
    with pytest.raises(FileChangedError):
        memory.save(path)  # the first memory's file was replaced too
    b.save(path, overwrite=True)
    assert kvedit.Memory.load(path, model, tok).messages == b.messages
    b.save(tmp_path / "other.kv")  # another file: nothing to check
    path.unlink()
    b.save(path)  # a removed file holds no one's work


def _reseal(path, change):
    """``change(attachment)``, then the header digest recomputed as anyone can: the file loads
    with an unknown history."""

    def edit(meta):
        change(meta["attachment"])
        meta["seal"].pop("mac")  # even a file whose header is unchanged

    edit_file_header(path, edit, reseal=True)


BAD = {
    "huge-turn": (set_at("turns", 1, "end", 1_000_000), r"turns\[1\]\.end is 1000000"),
    "bot-role": (set_at("messages", 1, "role", "bot"), r"messages\[1\]\.role is 'bot'"),
    "turn-role": (set_at("turns", 1, "role", "bot"), r"turns\[1\] does not hold message 1's"),
    "turn-content": (set_at("turns", 2, "content", "Hi"), r"turns\[2\] does not hold message 2's"),
    "version": (set_at("version", 99), "version 99 is not supported"),
    "unknown-field": (set_at("extra", 1), "'extra'"),
    "turn-start-str": (set_at("turns", 0, "start", "0"), r"turns\[0\]\.start is '0'"),
    "turn-count": (set_at("turns", 1, "computed", -5), r"turns\[1\]\.computed is -5"),
    "turn-source": (set_at("turns", 1, "source", "magic"), r"turns\[1\]\.source"),
    "turns-short": (lambda a: a["turns"].pop(), "are 8 for 9 messages"),
    "round-at": (set_at("rounds", 0, "at_message", "x"), r"rounds\[0\]\.at_message is 'x'"),
    "round-past": (set_at("rounds", 0, "at_message", 99), r"rounds\[0\]\.at_message is 99"),
    "round-grows": (set_at("rounds", 0, "after", 10**6), r"rounds\[0\]\.after"),
    "round-seconds": (set_at("rounds", 0, "seconds", -1.0), r"rounds\[0\]\.seconds is -1.0"),
    "round-nan": (set_at("rounds", 0, "seconds", float("nan")), r"rounds\[0\]\.seconds is nan"),
    "round-policy": (set_at("rounds", 0, "policy", 5), r"rounds\[0\]\.policy"),
    "budget-zero": (set_at("budget", "max_tokens", 0), r"budget\.max_tokens is 0"),
    "budget-recent": (set_at("budget", "recent", -1), r"budget\.recent is -1"),
    "budget-forget": (
        set_at("budget", "forget", 5),
        r"budget\.forget is 5 \(a int\), not a policy's name",
    ),
    "budget-quantize": (set_at("budget", "quantize", 3), r"budget\.quantize is 3"),
    "budget-span": (set_at("budget", "protect", [{"chars": [5, 1]}]), r"budget\.protect"),
}


@pytest.fixture()
def forgot(llama, tmp_path):
    """A memory file with a forgetting round."""
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=60, forget="window")
    for role, content in CHAT * 2:
        mem.add(role, content)
    assert mem.forgetting
    return mem, mem.save(tmp_path / "forgot.kv")


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_field_of_a_resealed_memory_is_checked_at_load(forgot, case):
    mem, path = forgot
    change, said = BAD[case]
    _reseal(path, change)
    with pytest.raises(CorruptCacheError, match=f"forgot.kv: the memory's .*{said}"):
        kvedit.Memory.load(path, mem.model, mem.tokenizer)


def test_a_resealed_memory_that_claims_nothing_false_loads(forgot):
    """Resealed (history unknown) but every field true: usable when loaded explicitly."""
    mem, path = forgot
    _reseal(path, lambda a: None)
    loaded = kvedit.Memory.load(path, mem.model, mem.tokenizer)
    assert not loaded.state.history.known
    assert loaded.messages == mem.messages and loaded.forgetting == mem.forgetting
    assert [(t.start, t.end) for t in loaded.turns] == [(t.start, t.end) for t in mem.turns]
    assert "forgetting" in loaded.explain()


def test_a_sealed_memory_whose_turns_do_not_tile_its_tokens_is_corrupt(forgot):
    """Even under this installation's key, turns must cover the tokens in order."""
    mem, path = forgot
    tensors = read_state_file(path).tensors

    def lie(meta):
        meta["attachment"]["turns"][1]["end"] = 1_000_000
        meta["seal"] = make_seal(meta, tensors_digest(tensors))

    edit_file_header(path, lie)
    with pytest.raises(
        CorruptCacheError,
        match=r"forgot.kv: the memory's turns\[2\]\.start is \d+, not where turns\[1\] ends",
    ):
        kvedit.Memory.load(path, mem.model, mem.tokenizer)
