"""kvedit.Memory.undo (#69): the last add or remembered ask taken back exactly (the state, its
digest, the messages, turns and forgetting rounds as they were), a bounded stack of
:data:`~kvedit.memory.undoing.UNDO_STEPS`, refused with a clear error when nothing is left, and
nothing to undo in a memory just loaded."""

from __future__ import annotations

import pytest

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.memory.undoing import UNDO_STEPS


def _snapshot(memory: kvedit.Memory) -> tuple:
    return (
        memory.state.digest,
        memory.state.token_ids.tolist(),
        memory.messages,
        memory.turns,
        memory.forgetting,
        memory.nbytes,
        memory.last_answer,
        memory.last_focus,
    )


def test_undo_takes_back_an_ask_and_an_add_exactly(llama):
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.")
    start = _snapshot(memory)
    memory.ask("My locker code is 4821.", max_new_tokens=6)
    asked = _snapshot(memory)
    memory.add("user", "A note.")
    memory.undo()
    assert _snapshot(memory) == asked
    memory.undo()
    assert _snapshot(memory) == start
    # what was undone is gone: the same question again gives the same memory
    memory.ask("My locker code is 4821.", max_new_tokens=6)
    assert _snapshot(memory) == asked


def test_undo_under_a_budget_restores_what_was_forgotten(llama):
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.", max_tokens=40, forget="kvzip")
    memory.ask("Tell me about the weather today, in detail please.", max_new_tokens=12)
    before = _snapshot(memory)
    memory.ask("And about tomorrow's weather, in as much detail?", max_new_tokens=12)
    assert len(memory.forgetting) > len(before[4])  # the second answer forgot
    memory.undo()
    assert _snapshot(memory) == before


def test_nothing_to_undo_is_refused_and_the_stack_is_bounded(llama, tmp_path):
    model, tok = llama
    memory = kvedit.Memory(model, tok)
    with pytest.raises(InvalidInputError, match="nothing to undo"):
        memory.undo()
    memory.ask("Hi?", max_new_tokens=3, remember=False)  # not a change
    assert memory.undoable == 0
    for k in range(UNDO_STEPS + 2):
        memory.add("user", f"note {k}")
    assert memory.undoable == UNDO_STEPS
    for _ in range(UNDO_STEPS):
        memory.undo()
    assert len(memory) == 2
    with pytest.raises(InvalidInputError, match=f"the last {UNDO_STEPS} changes"):
        memory.undo()
    assert len(memory) == 2


def test_a_loaded_memory_has_nothing_to_undo_and_a_save_keeps_the_stack(llama, tmp_path):
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.")
    before = _snapshot(memory)
    memory.ask("Hi?", max_new_tokens=4)
    path = memory.save(tmp_path / "m.kv")
    memory.undo()  # the file is now behind the memory
    assert _snapshot(memory) == before
    loaded = kvedit.Memory.load(path, model, tok)
    assert len(loaded) == 3 and loaded.undoable == 0
    with pytest.raises(InvalidInputError, match="nothing to undo"):
        loaded.undo()
