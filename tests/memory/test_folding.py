"""The one turn fold (:mod:`kvedit.memory.folding`) that :class:`kvedit.Memory` and the
server's memories both follow.

* Without a budget the fold keeps the state as it is (nothing scored, nothing forgotten).
* Under a budget it is what a Memory does: a Memory's state after ``add`` equals the fold of the
  same tokens appended to its state before.
* The system messages' turns the server computes (:func:`~kvedit.memory.folding.system_turns`)
  are the turns a Memory records, wherever a system message stands.
* ``settle`` gives compact positions only where the budget repositions ``"always"``.
"""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.memory.folding import fold_turn, system_turns
from kvedit.memory.repositioning import is_compact
from kvedit.states.capturing import extend_ids

SYSTEM = "You keep notes for the user."
USERS = [
    "Alice's code is 4821 and Bob's is 7310. Please remember both.",
    "Carol's code is 5902. What is Alice's code?",
    "And what is Bob's code? Answer with the number only.",
]


def _budgeted(model, tok, **kw):
    per_token = kvedit.capture_tokens(model, tok, [1]).nbytes
    return kvedit.Memory(model, tok, system=SYSTEM, max_bytes=64 * per_token, forget="knorm", **kw)


def test_without_a_budget_the_fold_keeps_the_state(llama):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system=SYSTEM)
    done = fold_turn(None, mem.state, None, 0, mem.turns, mem.messages, mem._rendering)
    assert done.state is mem.state and done.scores is None
    assert done.rounds == () and done.forgot == 0


def test_under_a_budget_the_fold_is_what_memory_add_does(llama):
    model, tok = llama
    mem = _budgeted(model, tok, keep="token")
    for text in USERS[:2]:
        mem.add("user", text)
    before, n = mem.state, len(mem.state)
    turn = mem.add("user", USERS[2])
    assert mem.forgetting, "the budget never forgot: the test checks nothing"
    rendering = mem._rendering
    appended = extend_ids(before, rendering.ids[n:], rendering.offsets[n:], rendering.text)
    done = fold_turn(mem.budget, appended, None, n, mem.turns, mem.messages, rendering)
    assert turn.end == len(done.state)
    for a, b in zip(done.state.layers, mem.state.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index)
        assert torch.allclose(a.keys, b.keys) and torch.allclose(a.values, b.values)
    assert done.forgot == sum(len(x) for x in appended.layers) - sum(
        len(x) for x in done.state.layers
    )
    assert len(done.rounds) == (1 if mem.forgetting[-1].at_message == turn.index else 0)


def test_system_turns_are_the_turns_memory_records(llama):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system=SYSTEM, prompt="plain")
    mem.add("user", USERS[0])
    mem.add("system", "From now on, answer in French.")
    mem.add("user", USERS[1])
    want = [(t.index, t.start, t.end) for t in mem.turns if t.role == "system"]
    got = [(t.index, t.start, t.end) for t in system_turns(mem.renderer, mem.messages)]
    assert len(want) == 2 and got == want


def test_settle_compacts_only_a_budget_that_repositions_always(llama):
    model, tok = llama
    for reposition, compact in (("always", True), ("at_limit", False)):
        mem = _budgeted(model, tok, keep="token", reposition=reposition)
        for text in USERS:
            mem.add("user", text)
        assert mem.forgetting and not is_compact(mem.state)  # gaps left by forgetting
        done = fold_turn(
            mem.budget, mem.state, None, len(mem.state), mem.turns, mem.messages, mem._rendering,
            settle=True,
        )  # fmt: skip
        assert is_compact(done.state) is compact


def test_a_fold_of_tokens_not_in_the_state_or_without_turns_is_refused(llama):
    model, tok = llama
    mem = _budgeted(model, tok)
    state, rendering = mem.state, mem._rendering
    with pytest.raises(InvalidInputError, match="start=99"):
        fold_turn(mem.budget, state, None, 99, mem.turns, mem.messages, rendering)
    with pytest.raises(InvalidInputError, match="needs the turns"):
        fold_turn(mem.budget, state, None, 0, [], mem.messages, rendering)
