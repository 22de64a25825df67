"""What a memory is told where it is made or loaded is honoured or refused by name (#65, #66):
forgetting keywords without a budget, ``keep=`` (the one option in place of ``per_head``/
``per_layer``) and ``exact_messages=`` (formerly ``recent``) with their older names still read,
a per-head file loaded with ``per_head=False``, a file whose policy is not registered here, a
missing path, and focus asked of a memory that forgot per KV head."""

from __future__ import annotations

import pytest

import kvedit
from kvedit.cache import is_headwise
from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.memory.budget import budget_from
from kvedit.memory.files import memory_attachment
from kvedit.states.files.write import save_state

CHAT = [
    ("user", "My locker code is 4821."),
    ("assistant", "Noted."),
    ("user", "My badge number is 77."),
    ("assistant", "Got it: 77."),
]


def _saved(model, tok, path, **budget):
    mem = kvedit.Memory(model, tok, system="You are terse.", **budget)
    for role, content in CHAT * 2:
        mem.add(role, content)
    return mem, mem.save(path)


@pytest.mark.parametrize("keywords", [dict(forget="knorm"), dict(protect="4821")])
def test_forgetting_keywords_without_a_budget_are_refused(llama, keywords):
    """As ``kvedit chat`` refuses --forget without --max-tokens/--max-bytes."""
    with pytest.raises(InvalidInputError, match="without a budget: give max_tokens= or max_bytes="):
        kvedit.Memory(*llama, **keywords)


def test_keep_is_one_option_and_the_older_keywords_map_to_it(llama):
    model, tok = llama
    made = {k: kvedit.Memory(model, tok, max_tokens=90, forget="kvzip", keep=k) for k in
            ("head", "layer", "token")}  # fmt: skip
    assert [(b.budget.per_head, b.budget.per_layer) for b in made.values()] == [
        (True, True), (False, True), (False, False)
    ]  # fmt: skip
    old = dict(per_head=True), dict(per_head=False), dict(per_layer=False)
    for kw, keep in zip(old, made, strict=True):
        assert kvedit.Memory(model, tok, max_tokens=90, forget="kvzip", **kw).budget.keep == keep
    auto = kvedit.Memory(model, tok, max_tokens=90, forget="kvzip", keep="auto").budget
    assert auto.keep == "head"  # an arrival policy, two KV heads, an entry budget
    for bad, says in (
        (dict(keep="heads"), "keep must be one of"),
        (dict(keep="head", per_head=True), "not both"),
        (dict(keep="head", forget="knorm"), "scores at each round"),
    ):
        with pytest.raises(InvalidInputError, match=says):
            kvedit.Memory(model, tok, max_tokens=90, **{"forget": "kvzip", **bad})
    state = kvedit.Memory(model, tok).state
    with pytest.raises(TypeError):
        budget_from(state, 90, None, "kvzip", 16, None)  # keyword-only
    assert budget_from(state, max_tokens=90, forget="kvzip", keep="token").keep == "token"


def test_exact_messages_is_recent_renamed_and_old_files_still_read(llama, tmp_path):
    model, tok = llama
    mem = kvedit.Memory(model, tok, quantize=4, exact_messages=3)
    assert mem.exact_messages == kvedit.Memory(model, tok, quantize=4, recent=3).exact_messages == 3
    with pytest.raises(InvalidInputError, match="not both"):
        kvedit.Memory(model, tok, quantize=4, exact_messages=3, recent=3)
    full, path = _saved(
        model, tok, tmp_path / "new.kv", max_tokens=200, forget="kvzip", keep="layer"
    )
    assert kvedit.Memory.load(path, model, tok).budget == full.budget
    # a file written before keep= and exact_messages= kept per_head, per_layer and recent
    old = tmp_path / "old.kv"
    budget = {"max_tokens": 200, "max_bytes": None, "forget": "kvzip", "recent_tokens": 16,
              "per_head": False, "per_layer": False, "protect": [], "recent": 3, "quantize": None}  # fmt: skip
    att = memory_attachment(full.prompt, full.messages, full.turns, full.forgetting, budget)
    save_state(full.state, old, attachment=att)
    loaded = kvedit.Memory.load(old, model, tok)
    assert (loaded.budget.keep, loaded.exact_messages) == ("token", 3)
    assert kvedit.Memory.load(old, model, tok, per_head=False).budget.keep == "layer"


def test_a_per_head_file_loaded_with_per_head_false_is_refused_not_relabelled(llama, tmp_path):
    """Its layers hold other entries on each head: loading it "per_head=False" would write
    ``per_head: false`` over per-head rows. One that forgot nothing yet is honoured truly."""
    model, tok = llama
    mem, path = _saved(model, tok, tmp_path / "m.kv", max_tokens=90, forget="kvzip")
    assert any(map(is_headwise, mem.state.layers))
    before = path.read_bytes()
    for kw in (dict(per_head=False), dict(keep="layer"), dict(keep="token")):
        with pytest.raises(InvalidInputError, match="forgot per KV head.*cannot undo"):
            kvedit.Memory.load(path, model, tok, **kw)
    assert path.read_bytes() == before
    assert kvedit.Memory.load(path, model, tok, max_tokens=None).budget is None
    fresh = kvedit.Memory(model, tok, system="Hi.", max_tokens=500, forget="kvzip")
    assert fresh.budget.per_head and not any(map(is_headwise, fresh.state.layers))
    fresh.save(tmp_path / "fresh.kv")
    honoured = kvedit.Memory.load(tmp_path / "fresh.kv", model, tok, per_head=False)
    assert honoured.budget.keep == "layer"
    honoured.save(tmp_path / "fresh.kv")
    assert kvedit.Memory.load(tmp_path / "fresh.kv", model, tok).budget.keep == "layer"


def test_focus_on_a_memory_that_forgot_per_head_is_refused_with_advice_that_fits(llama, tmp_path):
    model, tok = llama
    mem, path = _saved(model, tok, tmp_path / "m.kv", max_tokens=90, forget="kvzip")
    for memory in (mem, kvedit.Memory.load(path, model, tok)):
        before = memory.state.digest
        with pytest.raises(InvalidInputError, match="ask without focus") as refused:
            memory.ask("What is my locker code?", 3, focus=True)
        assert "per_head=False" not in str(refused.value) and memory.state.digest == before


def test_an_unregistered_policy_in_a_file_is_named_and_forget_replaces_it(llama, tmp_path):
    model, tok = llama
    mem, _ = _saved(model, tok, tmp_path / "m.kv", max_tokens=200, forget="knorm")
    path = tmp_path / "custom.kv"
    budget = {"max_tokens": 200, "max_bytes": None, "forget": "my-policy", "recent_tokens": 16,
              "keep": "layer", "protect": [], "exact_messages": 2, "quantize": None}  # fmt: skip
    att = memory_attachment(mem.prompt, mem.messages, mem.turns, mem.forgetting, budget)
    save_state(mem.state, path, attachment=att)
    with pytest.raises(InvalidInputError, match="'my-policy', which is not registered") as e:
        kvedit.Memory.load(path, model, tok)
    assert "pass forget=" in str(e.value)
    loaded = kvedit.Memory.load(path, model, tok, forget="knorm")
    assert loaded.budget.policy == "knorm" and loaded.budget.max_tokens == 200
    assert kvedit.Memory.load(path, model, tok, max_tokens=None).budget is None


def test_loading_a_missing_path_names_it(llama, tmp_path):
    missing = tmp_path / "nowhere.kv"
    with pytest.raises(InvalidInputError, match="nowhere.kv: no such memory file"):
        kvedit.Memory.load(missing, *llama)
    with pytest.raises(InvalidTypeError):
        kvedit.Memory.load(3, *llama)
