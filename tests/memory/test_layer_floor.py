"""``Memory(layer_floor=)``: no global layer starves under one ranking across layers (#67,
item 0).

The tiny Llama's second layer is made to attend evenly (its queries zeroed): every entry of it
then scores 1/n under ``kvzip``, below the other layers' best, and the one ranking across
layers leaves it only its protected entries. With ``layer_floor=f`` each global layer keeps at
least ``f`` of the room (an arrival policy forgets to ``max_tokens``); 0 is forgetting as
before, entry for entry. The option is kept in the memory file (written only when set) and a
bad value is refused by ``Memory``, by a file's budget and by ``Budget.from_json``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import kvedit
from kvedit.errors import CorruptCacheError, InvalidInputError
from kvedit.memory.attached import check_fields
from kvedit.memory.budget import Budget
from kvedit.memory.forgetting import global_entries, layer_entries
from kvedit.states.files.read import read_state_file
from kvedit.testing import tiny_model

SYSTEM = "You are terse."
MESSAGES = (
    "My locker code is 4821 and my badge is 77. " * 3,
    "The river is calm near the old bridge today. Alice's secret number is 5902. " * 3,
    "Bob parked the blue car on level seven of the garage near the exit. " * 3,
)
MAX_TOKENS = 100
BAD = [-0.1, 1.0, math.nan, "0.5", True, None]


@pytest.fixture(scope="module")
def flat():
    """The tiny Llama with its layer 1 attending evenly (a layer one ranking starves)."""
    model, tok = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.zero_()
    return model, tok


def _memory(flat, **kw) -> kvedit.Memory:
    model, tok = flat
    with torch.no_grad():
        mem = kvedit.Memory(model, tok, system=SYSTEM, max_tokens=MAX_TOKENS, forget="kvzip", **kw)
        for message in MESSAGES:
            mem.add("user", message)
    assert mem.forgetting
    return mem


def _last_round(mem: kvedit.Memory) -> dict:
    """The params of the memory's last ``forget`` history step."""
    return [s.params for s in mem.state.history.steps if s.name == "forget"][-1]


def _entries(mem: kvedit.Memory) -> list[float]:
    return [layer_entries(mem.state, i) for i in mem.state.counted_layers]


@pytest.mark.parametrize("keep", ["layer", "head"])
def test_floor_zero_forgets_as_before_entry_for_entry(flat, keep):
    before = _memory(flat, keep=keep)
    zero = _memory(flat, keep=keep, layer_floor=0.0)
    assert zero.budget == before.budget and "layer_floor" not in zero.budget.to_json()
    for old, new in zip(before.state.layers, zero.state.layers, strict=True):
        assert torch.equal(old.keys, new.keys) and torch.equal(old.values, new.values)
        assert torch.equal(old.positions, new.positions)
    assert "floor" not in _last_round(zero)


@pytest.mark.parametrize("keep", ["layer", "head"])
def test_a_floor_keeps_every_global_layer_its_share(flat, keep):
    starved = _memory(flat, keep=keep)
    assert min(_entries(starved)) < 0.5 * MAX_TOKENS  # the setting starves a layer without it
    floored = _memory(flat, keep=keep, layer_floor=0.5)
    assert min(_entries(floored)) >= 0.5 * MAX_TOKENS, _entries(floored)
    assert global_entries(floored.state) <= MAX_TOKENS  # the budget still holds
    assert _last_round(floored)["floor"] == 0.5


def test_the_floor_is_kept_in_the_memory_file(flat, tmp_path):
    model, tok = flat
    path = _memory(flat, layer_floor=0.5).save(tmp_path / "mem.kv")
    assert read_state_file(path).meta["attachment"]["budget"]["layer_floor"] == 0.5
    assert kvedit.Memory.load(path, model, tok).budget.layer_floor == 0.5
    assert kvedit.Memory.load(path, model, tok, layer_floor=0.25).budget.layer_floor == 0.25
    assert kvedit.Memory.load(path, model, tok, max_tokens=None).budget is None  # dropped
    plain = _memory(flat).save(tmp_path / "plain.kv")  # not written at 0: older readers read it
    assert "layer_floor" not in read_state_file(plain).meta["attachment"]["budget"]


@pytest.mark.parametrize("value", BAD)
def test_a_bad_floor_is_refused_by_memory_naming_it_and_its_range(flat, value):
    model, tok = flat
    with pytest.raises(InvalidInputError, match=r"layer_floor must be a number in \[0, 1\)"):
        kvedit.Memory(model, tok, max_tokens=MAX_TOKENS, forget="kvzip", layer_floor=value)


def test_a_floor_without_a_budget_is_refused(flat):
    model, tok = flat
    with pytest.raises(InvalidInputError, match="layer_floor= without a budget"):
        kvedit.Memory(model, tok, layer_floor=0.5)
    assert kvedit.Memory(model, tok, layer_floor=0.0).budget is None


@pytest.mark.parametrize("value", BAD)
def test_a_bad_floor_in_a_file_is_refused_by_name(flat, tmp_path, value):
    path = _memory(flat, layer_floor=0.5).save(tmp_path / "mem.kv")
    found = read_state_file(path)
    attachment = copy.deepcopy(found.meta["attachment"])
    attachment["budget"]["layer_floor"] = value
    with pytest.raises(CorruptCacheError, match=r"budget\.layer_floor is .*not a number in \[0"):
        check_fields(attachment, path, len(found.tensors["token_ids"]))
    with pytest.raises(InvalidInputError, match=r"budget\.layer_floor must be a number in \[0"):
        Budget.from_json(attachment["budget"])


def test_loading_without_a_budget_drops_the_files_reposition_too(flat, tmp_path):
    """Found beside the floor: a file's ``reposition`` was kept with ``max_tokens=None`` and
    refused as ``reposition=`` without a budget."""
    model, tok = flat
    mem = kvedit.Memory(model, tok, system=SYSTEM, max_tokens=MAX_TOKENS, reposition="always")
    path = mem.save(tmp_path / "mem.kv")
    assert kvedit.Memory.load(path, model, tok, max_tokens=None).budget is None
