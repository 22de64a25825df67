"""kvedit.memory.repositioning: a memory's kept entries given compact positions, keys moved by
each layer's own RoPE; exact where the move is a uniform shift, refused where it cannot be done."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.cache.headwise import is_headwise, keep_per_head
from kvedit.compress.quantization import quantize
from kvedit.errors import InvalidInputError, ModelNotAttachedError
from kvedit.memory.repositioning import compact_end, compact_positions, is_compact
from kvedit.rope import movers

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away. " * 3


def dropped(state: kvedit.KVState, keep) -> kvedit.KVState:
    """``state`` with its global layers holding only the tokens ``keep(token_index)`` says."""
    layers = []
    for layer in state.layers:
        if layer.window is None:
            layer = layer.select(keep(layer.token_index).nonzero().flatten())
        layers.append(layer)
    return state.replace(layers=layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_uniform_shift_is_exact(arch):
    """Forgetting the first tokens leaves no gap inside: compacting moves every entry by the
    same amount, and RoPE attends by distance, so the next tokens' logits are unchanged (Gemma-3:
    sliding and global layers, each its own RoPE base)."""
    model, tok = _model(arch)
    state = kvedit.capture(model, tok, TEXT)
    k = 10
    gone = dropped(state, lambda index: index >= k)
    moved = compact_positions(gone)
    assert moved.next_position == gone.next_position - k
    assert compact_end(gone) == len(gone) - k and is_compact(moved)
    for a, b in zip(gone.layers, moved.layers, strict=True):
        assert torch.equal(b.positions, a.positions - k)
    before = gone.logits(" and the dog sleeps")
    after = moved.logits(" and the dog sleeps")
    assert (before - after).abs().max().item() < 1e-4


_MODELS: dict = {}


def _model(arch):
    from kvedit.testing import tiny_model

    if arch not in _MODELS:
        _MODELS[arch] = tiny_model(arch)
    return _MODELS[arch]


def test_gaps_are_closed_and_recorded(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    n = len(state)
    gone = dropped(state, lambda index: (index < 4) | (index >= n - 20))
    digest = gone.digest
    keys = [layer.keys.clone() for layer in gone.layers]
    moved = compact_positions(gone, reason="always")
    assert moved.next_position == 24
    assert is_compact(moved) and not is_compact(gone)
    assert moved.layers[0].positions.tolist() == list(range(24))
    # the text's tokens: kept ones at their new places, a forgotten one at the next kept one's
    assert moved.position_ids[:4].tolist() == [0, 1, 2, 3]
    assert moved.position_ids[4:].max().item() == 23
    assert moved.position_ids[n - 20 :].tolist() == list(range(4, 24))
    assert int(moved.position_ids[10]) == 4
    assert moved.last_input.position == 23
    step = moved.history.steps[-1]
    assert (step.kind, step.name, step.exact) == ("reposition", "compact_positions", False)
    assert step.params["next_position"] == [n, 24]
    assert step.params["reason"] == "always"
    # the state it came from is untouched
    assert gone.digest == digest
    assert all(torch.equal(a, b.keys) for a, b in zip(keys, gone.layers, strict=True))
    # each key is the old one moved by its own delta: moved back, it is the old key
    mover = movers(model)[0]
    delta = moved.layers[0].positions - gone.layers[0].positions
    back = mover.move(moved.layers[0].keys, -delta)
    assert (back - gone.layers[0].keys).abs().max().item() < 1e-4
    assert compact_positions(moved) is moved  # compact already: nothing to do


def test_each_kv_head_moves_by_its_own_positions(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    n = len(state)
    layer = state.layers[0]
    heads = layer.kv_shape[1]
    kept = torch.zeros(heads, n, dtype=torch.bool)
    kept[:, -8:] = True
    kept[0, :6] = True  # head 0 keeps the first tokens, the others some in the middle
    kept[1:, 20:23] = True
    per_head = keep_per_head(layer, kept)
    assert is_headwise(per_head)
    gone = dropped(
        state, lambda index: (index < 6) | ((index >= 20) & (index < 23)) | (index >= n - 8)
    )
    gone = gone.replace(layers=[per_head, *gone.layers[1:]])
    moved = compact_positions(gone)
    out = moved.layers[0]
    assert is_headwise(out)
    assert torch.equal(out.head_index, per_head.head_index)
    held = per_head.held()
    end = compact_end(gone)
    # the layer or head holding most gives the new next position
    assert end == max(int(held.sum(dim=1).max()), *(len(x) for x in gone.layers[1:]))
    for h in range(heads):  # each head's entries consecutive, in order, the newest at end - 1
        got = out.head_positions[h, held[h]]
        assert got.tolist() == list(range(end - int(held[h].sum()), end))
    mover = movers(model)[0]
    for h in range(heads):
        delta = torch.where(held[h], out.head_positions[h] - per_head.head_positions[h], 0)
        back = mover.move(out.keys[:, h : h + 1], -delta)
        assert (back - per_head.keys[:, h : h + 1]).abs().max().item() < 1e-4


def test_a_packed_layer_is_refused_before_any_work(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    packed = quantize(state, bits=4)
    assert any(layer.packed for layer in packed.layers)
    with pytest.raises(InvalidInputError, match="quantize="):
        compact_positions(packed)


def test_no_model_is_refused_by_name(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    gone = dropped(state, lambda index: index >= 5).replace(model=None)
    with pytest.raises(ModelNotAttachedError, match="attach the model"):
        compact_positions(gone)


def test_budget_reposition_is_checked_and_kept(llama):
    from kvedit.memory.budget import Budget, budget_from
    from kvedit.states.capturing import empty_state

    model, tok = llama
    state = empty_state(model, tok)
    with pytest.raises(InvalidInputError, match="reposition must be one of"):
        budget_from(state, max_tokens=64, reposition="sometimes")
    with pytest.raises(InvalidInputError, match="reposition= without a budget"):
        budget_from(state, reposition="always")
    with pytest.raises(InvalidInputError, match="quantize="):
        budget_from(state, max_tokens=64, reposition="always", quantize=4)
    assert budget_from(state, max_tokens=64).reposition == "at_limit"
    budget = budget_from(state, max_tokens=64, reposition="never")
    data = budget.to_json()
    assert data["reposition"] == "never"
    assert Budget.from_json(data).reposition == "never"
    assert "reposition" not in budget_from(state, max_tokens=64).to_json()  # files read as before


NOTES = [f"Note {i}: the spare key is in drawer {i}." for i in range(40)]


def memory(model, tok, **kw) -> kvedit.Memory:
    return kvedit.Memory(model, tok, system="You keep notes.", max_positions=160, **kw)


def test_a_memory_under_a_budget_goes_on_past_the_models_positions(llama, tmp_path):
    model, tok = llama
    mem = memory(model, tok, max_tokens=48, forget="knorm")
    for note in NOTES:
        mem.add("user", note)
    assert sum(t.n_tokens for t in mem.turns) > 3 * 160
    assert mem.state.next_position <= 160
    steps = [s for s in mem.state.history.steps if s.kind == "reposition"]
    assert steps and all(s.params["reason"] == "at_limit" for s in steps)
    assert mem.reposition_seconds > 0
    mem.ask("Which drawer holds the key?", max_new_tokens=8)  # an answer past the positions too
    # saved and loaded, it goes on as the memory it was
    path = mem.save(tmp_path / "notes.kvmem")
    again = kvedit.Memory.load(path, model, tok, max_positions=160)
    assert again.budget.reposition == "at_limit" and again.state.digest == mem.state.digest
    for m in (mem, again):
        for note in NOTES[:12]:
            m.add("user", note)
    assert again.state.digest == mem.state.digest
    assert (again.state.last_logits - mem.state.last_logits).abs().max().item() < 1e-4


def test_before_the_limit_nothing_moves(llama):
    model, tok = llama
    a = memory(model, tok, max_tokens=48, forget="knorm")
    b = memory(model, tok, max_tokens=48, forget="knorm", reposition="never")
    for note in NOTES[:4]:
        a.add("user", note)
        b.add("user", note)
    assert a.state.next_position < 160 and a.forgetting  # forgot, not yet at the limit
    assert a.state.digest == b.state.digest


def test_always_keeps_positions_compact(llama):
    """Before every message the gaps are closed: the next position stays near what is held,
    where without it the positions grow with every token read."""
    model, tok = llama
    mem = memory(model, tok, max_tokens=48, forget="knorm", reposition="always")
    for note in NOTES[:10]:
        end = compact_end(mem.state)
        mem.add("user", note)
        assert mem.state.next_position == end + mem.turns[-1].n_tokens
    assert sum(t.n_tokens for t in mem.turns) > 2 * mem.state.next_position
    steps = [s for s in mem.state.history.steps if s.kind == "reposition"]
    assert steps and steps[-1].params["reason"] == "always"


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 48, "forget": "knorm", "reposition": "never"},
        {},  # no budget: nothing forgotten, no gap to close
        {"max_bytes": 48, "forget": "knorm", "quantize": 4},  # packed keys cannot move
    ],
)
def test_where_positions_cannot_be_compacted_the_memory_stops_with_the_room_error(llama, kw):
    model, tok = llama
    if "max_bytes" in kw:  # 72 tokens' bytes: a byte budget holds older messages packed
        kw = {**kw, "max_bytes": 72 * kvedit.capture_tokens(model, tok, [1]).nbytes}
    mem = memory(model, tok, **kw)
    with pytest.raises(InvalidInputError, match="positions") as err:
        for note in NOTES:
            mem.add("user", note)
    digest = mem.state.digest
    with pytest.raises(InvalidInputError):
        mem.add("user", NOTES[0])
    assert mem.state.digest == digest  # refused before any work
    if "quantize" in kw:
        assert any(layer.packed for layer in mem.state.layers)
        assert "quantize=" in str(err.value)


@pytest.mark.parametrize("reposition", ["at_limit", "always"])
def test_extend_past_the_positions_is_the_adds(llama, reposition):
    model, tok = llama
    a = memory(model, tok, max_tokens=48, forget="knorm", reposition=reposition)
    b = memory(model, tok, max_tokens=48, forget="knorm", reposition=reposition)
    for note in NOTES[:12]:
        a.add("user", note)
    b.extend([("user", note) for note in NOTES[:12]])
    assert any(s.kind == "reposition" for s in b.state.history.steps)
    assert a.state.digest == b.state.digest
    assert (a.state.last_logits - b.state.last_logits).abs().max().item() < 1e-4


def test_no_layer_keeps_more_than_its_share_of_the_positions(llama, learned_fit):
    """One ranking over the layers can give a layer nearly everything read; a memory that
    repositions caps each layer (each KV head) at POSITION_SHARE of the positions, so compact
    positions always leave room."""
    from kvedit.memory.repositioning import POSITION_SHARE

    model, tok = llama
    learned_fit(model, tok)
    mem = memory(model, tok, max_tokens=110, forget="learned")
    cap = int(POSITION_SHARE * 160)
    for note in NOTES[:20]:
        mem.add("user", note)
        assert max(layer.longest_head() for layer in mem.state.layers) <= cap
    assert any(s.kind == "reposition" for s in mem.state.history.steps)
