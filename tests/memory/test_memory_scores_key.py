"""A memory's arrival scores carry their scorer's key (a learned fit's digest): a memory saved
under one fit and loaded under a refit is scored again with the refit, never ranked with the
old fit's scores mixed in (#65)."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.memory.files import read_memory
from kvedit.memory.held import scored_from_scratch

CHAT = [
    ("user", "My locker code is 4821 and my badge is 77."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, the river is calm near the old bridge."),
    ("assistant", "It is sunny."),
]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)


def test_a_memory_saved_under_one_fit_is_scored_again_under_a_refit(llama, tmp_path, learned_fit):
    model, tok = llama
    first = learned_fit(model, tok, seed=0)
    mem = kvedit.Memory(
        model, tok, system="You are terse.", max_tokens=90, forget="learned", keep="layer"
    )
    for role, content in CHAT * 2:
        mem.add(role, content)
    path = mem.save(tmp_path / "m.kv")
    key = read_memory(path, model, tok).scores_key
    assert key == mem.budget.scorer.fit_digest(mem.state)  # the file names the fit
    same = kvedit.Memory.load(path, model, tok)  # the same fit: the file's scores are kept
    assert _same(same._held.scores, mem._held.scores)

    first.unlink()
    learned_fit(model, tok, seed=1)  # a refit, where learned looks first
    loaded = kvedit.Memory.load(path, model, tok)
    assert loaded.budget.scorer.fit_digest(loaded.state) != key
    fresh = scored_from_scratch(loaded.budget, loaded.state)
    assert _same(loaded._held.scores, fresh)  # scored again with the refit
    assert not _same(loaded._held.scores, mem._held.scores)


def test_a_memory_that_forgot_per_head_under_another_fit_is_refused_by_name(
    llama, tmp_path, learned_fit
):
    model, tok = llama
    first = learned_fit(model, tok, seed=0)
    mem = kvedit.Memory(model, tok, max_tokens=90, forget="learned", keep="head")
    for role, content in CHAT * 2:
        mem.add(role, content)
    path = mem.save(tmp_path / "m.kv")
    kvedit.Memory.load(path, model, tok)  # the same fit: loads
    first.unlink()
    learned_fit(model, tok, seed=1)
    with pytest.raises(InvalidInputError, match="scores were made under the fit"):
        kvedit.Memory.load(path, model, tok)
